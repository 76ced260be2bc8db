"""Per-rank model-state bytes of zerocore stages 0/1/2 at N = 2 and 4 ranks, measured from the
tensors the engine holds after a training step (``engine.memory_report()``: params, grads,
fp32 master, m, v, gradient buckets, each storage counted once), against ZeRO's formulas
(16-bit params + fp32 master: 2+2+12 bytes per parameter split by stage; fp32: 4+4+8).

    python benchmarks/memory.py --out benchmarks/results/memory_gloo.json --plot benchmarks/results/memory_gloo.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, spawn_ranks  # noqa: E402


def worker(rank: int, world: int, init: str, args, out: str) -> None:
    import zerocore
    from zerocore.demo import TinyGPT
    from zerocore.runtime.memory import formula_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    rows = []
    for dtype in args.dtypes:
        for stage in (0, 1, 2):
            torch.manual_seed(0)
            model = TinyGPT(65, args.dim, args.layers, heads=8, ctx=64)
            engine = zerocore.initialize(model, {
                "bf16": {"enabled": dtype == "bf16"},
                "zero_optimization": {"stage": stage, "reduce_bucket_size": int(args.bucket), "overlap_comm": True}})
            x = torch.randint(0, 65, (2, 65))
            loss = torch.nn.functional.cross_entropy(engine(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
            engine.backward(loss)
            engine.step()
            mem = engine.memory_report()
            psi = sum(g.layout.numel for g in engine.groups)
            want = formula_bytes(psi, world, stage, half=dtype == "bf16")
            rows.append({"world": world, "stage": stage, "dtype": dtype, "params": psi, "held": mem,
                         "formula_bytes": want, "held_minus_buckets": mem["total"] - mem["buckets"],
                         "ratio_to_formula": (mem["total"] - mem["buckets"]) / want,
                         "bytes_per_param": mem["total"] / psi})
            engine.reducer.remove_hooks()
            del engine, model
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def plot(rows, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return False
    dtypes = sorted({r["dtype"] for r in rows})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        sel = [r for r in rows if r["dtype"] == dtype]
        labels = [f"N={r['world']}\nstage {r['stage']}" for r in sel]
        xs = range(len(sel))
        roles = ["params", "grads", "master", "exp_avg", "exp_avg_sq", "buckets"]
        bottom = [0.0] * len(sel)
        for role in roles:
            vals = [r["held"][role] / r["params"] for r in sel]
            ax.bar(xs, vals, bottom=bottom, label=role)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(xs, [r["formula_bytes"] / r["params"] for r in sel], color="black", marker="_", s=400, zorder=3,
                   label="ZeRO formula")
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("bytes per parameter, per rank")
        ax.set_title(f"model states held per rank ({dtype})")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--bucket", type=float, default=5e5, help="reduce_bucket_size (elements)")
    ap.add_argument("--out")
    ap.add_argument("--plot")
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        rows += spawn_ranks(worker, world, args)
    print(f"{'N':>2} {'stage':>5} {'dtype':>5} {'held MB':>9} {'buckets MB':>10} {'formula MB':>10} "
          f"{'held-buckets / formula':>22} {'B/param':>8}")
    for r in rows:
        print(f"{r['world']:>2} {r['stage']:>5} {r['dtype']:>5} {r['held']['total'] / 2**20:>9.2f} "
              f"{r['held']['buckets'] / 2**20:>10.2f} {r['formula_bytes'] / 2**20:>10.2f} "
              f"{r['ratio_to_formula']:>22.4f} {r['bytes_per_param']:>8.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "rows": rows}, f, indent=2)
        print(f"wrote {args.out}")
    if args.plot and plot(rows, args.plot):
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
