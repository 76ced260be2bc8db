"""Host cost of the optimizer step: what the Python around the native kernels costs,
with tiny tensors so the arithmetic is negligible.

- ``adam_step_multi``: 200 tensors of ``--elems`` elements through ``zerocore.ops.adam_step_multi``
  against the bare native call; the difference is the argument checking in Python (its tensor
  checks run in C++ now).
- ``engine.step()`` at the accumulation boundary, world 1, fp32: the 100-block model of
  benchmarks/backward_overhead.py at stage 2 with 100 groups and stage 3 with 100 units; CPU
  time and zerocore Python / native calls per step.
- ``FusedAdam`` against ``torch.optim.AdamW`` (foreach and fused) on 200 tensors: CPU time and
  zerocore Python calls per step.

CPU time of this thread (``time.thread_time()``: the VM's steal and other processes are
excluded), one thread, variants interleaved, medians over rounds.

    PYTHONPATH=. python benchmarks/step_overhead.py --out benchmarks/results/step_overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import zerocore
from zerocore import ops
from zerocore.ops import FusedAdam, _loader
from _common import machine_info
from backward_overhead import make_model, stage_config

PKG = os.path.dirname(zerocore.__file__) + os.sep
TENSORS = 200


def counted(fn) -> tuple[int, int]:
    """(zerocore Python calls, native zerocore calls) made by ``fn()``."""
    n = [0, 0]

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PKG):
            n[0] += 1
        elif event == "c_call" and (getattr(arg, "__module__", None) or "").startswith("zerocore"):
            n[1] += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0], n[1]


def interleaved(variants: dict, rounds: int, reps: int) -> dict[str, float]:
    """Median CPU microseconds per call of each variant."""
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            t = time.thread_time()
            for _ in range(reps):
                fn()
            times[k].append((time.thread_time() - t) / reps * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def adam_lists(elems: int):
    g = torch.Generator().manual_seed(0)
    p = [torch.randn(elems, generator=g) for _ in range(TENSORS)]
    gr = [torch.randn(elems, generator=g) for _ in range(TENSORS)]
    m, v = [torch.zeros(elems) for _ in range(TENSORS)], [torch.zeros(elems) for _ in range(TENSORS)]
    return p, gr, m, v, [torch.empty(elems, dtype=torch.bfloat16) for _ in range(TENSORS)]


def bench_adam(args) -> dict:
    lib = _loader.load()
    p, g, m, v, outs = adam_lists(args.elems)
    steps = [1] * TENSORS

    def op(o):
        return lambda: ops.adam_step_multi(p, g, m, v, steps=steps, lr=1e-3, weight_decay=0.01, param_outs=o)

    def raw(o):
        return lambda: lib.adam_step_multi(p, g, m, v, o, steps, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, 1.0)

    t = interleaved({"op": op(None), "native": raw(None), "op_out": op(outs), "native_out": raw(outs),
                     "sumsq_multi": lambda: ops.sum_squares_multi(g),
                     "sumsq_loop": lambda: [ops.sum_squares(x) for x in g]}, args.rounds, args.reps)
    return {"tensors": TENSORS, "elems": args.elems, "us": t, "python_us": t["op"] - t["native"],
            "python_us_with_param_outs": t["op_out"] - t["native_out"]}


def bench_engine(args) -> dict:
    x = torch.randn(8, 16)
    engines = {}
    for name, stage, bucket in (("stage2_100_groups", 2, 400), ("stage3_100_units", 3, None)):
        cfg = stage_config(stage)
        if bucket:
            cfg["zero_optimization"]["reduce_bucket_size"] = bucket
        engines[name] = zerocore.initialize(make_model(100, 16), cfg)
    out = {}
    for name, e in engines.items():
        e.backward(e(x).square().mean())
        e.step()
        e.backward(e(x).square().mean())
        py, nat = counted(e.step)
        out[name] = {"groups": len(e.groups), "python_calls": py, "native_calls": nat, "us": []}
    for _ in range(args.rounds * 2):
        for name, e in engines.items():
            e.backward(e(x).square().mean())  # outside the clock
            t = time.thread_time()
            e.step()
            out[name]["us"].append((time.thread_time() - t) * 1e6)
    for r in out.values():
        r["us"] = statistics.median(r["us"])
    return out


def bench_fused(args) -> dict:
    def params():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(args.elems)) for _ in range(TENSORS)]
        for p in ps:
            p.grad = torch.randn(args.elems)
        return ps

    opts = {"zerocore_FusedAdam": FusedAdam(params(), lr=1e-3),
            "torch_AdamW_foreach": torch.optim.AdamW(params(), lr=1e-3, foreach=True),
            "torch_AdamW_fused": torch.optim.AdamW(params(), lr=1e-3, fused=True)}
    for o in opts.values():
        o.step()
        o.step()
    py, nat = counted(opts["zerocore_FusedAdam"].step)
    return {"tensors": TENSORS, "elems": args.elems, "python_calls": py, "native_calls": nat,
            "us": interleaved({k: o.step for k, o in opts.items()}, args.rounds, args.reps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elems", type=int, default=64, help="elements per tensor")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = {"machine": machine_info(), "load_avg": os.getloadavg(), "adam": bench_adam(args),
           "engine": bench_engine(args), "fused": bench_fused(args)}
    a = res["adam"]
    print(f"load average {res['load_avg'][0]:.1f}; CPU microseconds per call (medians), {TENSORS} tensors of "
          f"{args.elems}")
    print(f"adam_step_multi: op {a['us']['op']:.0f} vs native {a['us']['native']:.0f} (Python {a['python_us']:.0f}); "
          f"with param_outs {a['us']['op_out']:.0f} vs {a['us']['native_out']:.0f} "
          f"(Python {a['python_us_with_param_outs']:.0f})")
    print(f"sum of squares: sum_squares_multi {a['us']['sumsq_multi']:.0f} vs a loop of sum_squares "
          f"{a['us']['sumsq_loop']:.0f}")
    for name, r in res["engine"].items():
        print(f"engine.step() {name}: {r['us']:.0f} us, {r['python_calls']} zerocore Python calls, "
              f"{r['native_calls']} native calls")
    f = res["fused"]
    print(f"FusedAdam: {f['python_calls']} zerocore Python calls, {f['native_calls']} native call(s) per step; "
          + ", ".join(f"{k} {v:.0f} us" for k, v in f["us"].items()))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
