"""Per-rank model-state bytes of zerocore stages 0/1/2/3 and PyTorch FSDP2 at N = 2 and 4 ranks,
measured from the tensors held after a training step, against ZeRO's formulas (16-bit params +
fp32 master: 2+2+12 bytes per parameter split by stage; fp32: 4+4+8; stage 3 = 16/N).

zerocore: ``engine.memory_report()`` (params, gathered, grads, fp32 master, m, v, gradient
buckets, each storage counted once). FSDP2 (``fully_shard`` per block + root, torch AdamW; bf16
= ``MixedPrecisionPolicy(param_dtype=bf16)``): the storages of the sharded parameters' local
tensors (fp32: they are also the master), their sharded gradients and AdamW's exp_avg /
exp_avg_sq, counted the same way. Both are wrapped alike: a unit per ``Block`` plus the root.

Stage 3 keeps parameters under ``--persist`` elements (LayerNorms, biases) whole on every rank
(DeepSpeed's persistence threshold): the expected bytes are the formula plus those parameters'
replicated 16-bit copies, ``p_bytes * persistent * (N-1)/N``. Also recorded: the peak bytes
gathered during the forward (``engine.gatherer.peak_live`` x element size, exact) against the
two largest units; for FSDP2 the unsharded parameter bytes alive, sampled at every module's
forward pre/post hooks (a lower bound of its peak).

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

ROLES = ["params", "grads", "master", "exp_avg", "exp_avg_sq", "buckets", "gathered"]


def _batch():
    return torch.randint(0, 65, (2, 65), generator=torch.Generator().manual_seed(1))


def _storage_counter():
    seen: set[int] = set()

    def nbytes(t) -> int:
        if t is None:
            return 0
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()
    return nbytes


def zerocore_row(args, world: int, dtype: str, stage: int) -> dict:
    import zerocore
    from zerocore.demo import TinyGPT
    from zerocore.runtime.memory import formula_bytes

    torch.manual_seed(0)
    model = TinyGPT(65, args.dim, args.layers, heads=8, ctx=64)
    z = {"stage": stage, "reduce_bucket_size": int(args.bucket), "overlap_comm": True}
    if stage == 3:
        block = sum(p.numel() for p in model.blocks[0].parameters() if p.numel() >= args.persist)
        z.update(stage3_unit_classes=["Block"], stage3_param_persistence_threshold=args.persist,
                 stage3_prefetch_bucket_size=block)
    engine = zerocore.initialize(model, {"bf16": {"enabled": dtype == "bf16"}, "zero_optimization": z})
    x = _batch()
    peak_fwd = None
    for _ in range(2):  # the second step runs with the recorded order (prefetch on)
        if engine.gatherer is not None:
            engine.gatherer.peak_live = engine.gatherer.live
        logits = engine(x[:, :-1])
        if engine.gatherer is not None:
            peak_fwd = engine.gatherer.peak_live
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        engine.backward(loss)
        engine.step()
    mem = engine.memory_report()
    psi = sum(g.layout.numel for g in engine.groups)
    half = dtype == "bf16"
    want = formula_bytes(psi, world, stage, half=half)
    row = {"who": "zerocore", "world": world, "stage": stage, "dtype": dtype, "params": psi, "held": mem,
           "formula_bytes": want, "held_minus_buckets": mem["total"] - mem["buckets"],
           "ratio_to_formula": (mem["total"] - mem["buckets"]) / want, "bytes_per_param": mem["total"] / psi}
    if stage == 3:
        el = 2 if half else 4
        persistent = sum(g.layout.numel for g in engine.groups if not g.partitioned)
        units = sorted((u.padded for u in engine.gatherer.units if u.padded), reverse=True)
        expected = want + el * persistent * (world - 1) // world
        row.update(persistent_params=persistent, expected_bytes=expected,
                   ratio_to_expected=(mem["total"] - mem["buckets"]) / expected,
                   n_units=len(units), unit_elems=units, peak_gathered_fwd_bytes=peak_fwd * el,
                   peak_gathered_step_bytes=engine.gatherer.peak_live * el,
                   two_largest_units_bytes=sum(units[:2]) * el)
    engine.reducer.remove_hooks()
    if engine.gatherer is not None:
        engine.gatherer.remove_hooks()
    return row


def fsdp2_row(args, world: int, dtype: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from zerocore.demo import TinyGPT
    from zerocore.runtime.memory import formula_bytes

    torch.manual_seed(0)
    model = TinyGPT(65, args.dim, args.layers, heads=8, ctx=64)
    psi = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if dtype == "bf16" else MixedPrecisionPolicy()
    for b in model.blocks:
        fully_shard(b, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]

    def unsharded_bytes() -> int:
        nbytes = _storage_counter()
        n = 0
        for m in fsdp_modules:
            for pg in m._get_fsdp_state()._fsdp_param_groups:
                for fp in pg.fsdp_params:
                    n += sum(nbytes(t) for t in fp.all_gather_outputs)
        return n

    peak = [0]

    def sample(*_):
        peak[0] = max(peak[0], unsharded_bytes())
    hooks = [h for m in model.modules() for h in (m.register_forward_pre_hook(sample), m.register_forward_hook(sample))]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    x = _batch()
    for _ in range(2):
        peak[0] = 0
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        peak_fwd = peak[0]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the gradients, as zerocore's grads are counted
    for h in hooks:
        h.remove()
    nbytes = _storage_counter()
    held = dict.fromkeys(ROLES, 0)
    for p in model.parameters():
        held["params"] += nbytes(p)
        held["grads"] += nbytes(p.grad)
        st = opt.state.get(p, {})
        held["exp_avg"] += nbytes(st.get("exp_avg"))
        held["exp_avg_sq"] += nbytes(st.get("exp_avg_sq"))
    held["gathered"] = unsharded_bytes()
    held["total"] = sum(held[r] for r in ROLES)
    want = formula_bytes(psi, world, 3, half=dtype == "bf16")
    # the two largest "units" (a block, the root's own parameters), in the all-gather dtype
    el = 2 if dtype == "bf16" else 4
    sizes = sorted([sum(p.numel() for p in b.parameters()) for b in model.blocks]
                   + [psi - sum(p.numel() for b in model.blocks for p in b.parameters())], reverse=True)
    dist.barrier()
    return {"who": "fsdp2", "world": world, "stage": "fsdp2", "dtype": dtype, "params": psi, "held": held,
            "formula_bytes": want, "held_minus_buckets": held["total"], "ratio_to_formula": held["total"] / want,
            "bytes_per_param": held["total"] / psi, "peak_gathered_fwd_bytes": peak_fwd,
            "two_largest_units_bytes": sum(sizes[:2]) * el}


def worker(rank: int, world: int, init: str, args, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    rows = []
    for dtype in args.dtypes:
        for stage in args.stages:
            rows.append(fsdp2_row(args, world, dtype) if stage == "fsdp2"
                        else zerocore_row(args, world, dtype, int(stage)))
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
    fig, axes = plt.subplots(1, len(dtypes), figsize=(8 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        sel = [r for r in rows if r["dtype"] == dtype]
        labels = [f"N={r['world']}\n" + ("FSDP2" if r["stage"] == "fsdp2" else f"stage {r['stage']}") for r in sel]
        xs = range(len(sel))
        bottom = [0.0] * len(sel)
        for role, color in zip(ROLES, plt.get_cmap("tab10").colors):  # one color per role in both panels
            vals = [r["held"].get(role, 0) / r["params"] for r in sel]
            ax.bar(xs, vals, bottom=bottom, label=role, color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(xs, [r["formula_bytes"] / r["params"] for r in sel], color="black", marker="_", s=300, zorder=3,
                   label="ZeRO formula")
        s3 = [(i, r) for i, r in enumerate(sel) if "peak_gathered_fwd_bytes" in r]
        ax.scatter([i for i, _ in s3], [r["peak_gathered_fwd_bytes"] / r["params"] for _, r in s3], color="red",
                   marker="x", zorder=3, label="peak gathered in forward (not held between steps)")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("bytes per parameter, per rank")
        note = "; FSDP2's fp32 params are its master" if dtype == "bf16" else ""
        ax.set_title(f"model states held per rank after a step ({dtype}{note})", fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    ap.add_argument("--stages", nargs="+", default=["0", "1", "2", "3", "fsdp2"], choices=["0", "1", "2", "3", "fsdp2"])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--bucket", type=float, default=5e5, help="reduce_bucket_size (elements)")
    ap.add_argument("--persist", type=int, default=10_000,
                    help="stage 3: stage3_param_persistence_threshold (LayerNorms/biases whole, matrices partitioned)")
    ap.add_argument("--out")
    ap.add_argument("--plot")
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        rows += spawn_ranks(worker, world, args)
    mb = 2**20
    print(f"{'N':>2} {'stage':>5} {'dtype':>5} {'held MB':>9} {'buckets MB':>10} {'formula MB':>10} "
          f"{'held-buckets / formula':>22} {'B/param':>8}")
    for r in rows:
        print(f"{r['world']:>2} {r['stage']:>5} {r['dtype']:>5} {r['held']['total'] / mb:>9.2f} "
              f"{r['held']['buckets'] / mb:>10.2f} {r['formula_bytes'] / mb:>10.2f} "
              f"{r['ratio_to_formula']:>22.4f} {r['bytes_per_param']:>8.2f}")
    s3 = [r for r in rows if r["stage"] == 3]
    if s3:
        print("\nstage 3: formula + persistent params' replicated 16-bit copies; peak gathered in forward")
        print(f"{'N':>2} {'dtype':>5} {'persistent':>10} {'expected MB':>11} {'held-buckets / expected':>24} "
              f"{'peak fwd MB':>11} {'2 largest units MB':>18} {'units':>5}")
        for r in s3:
            print(f"{r['world']:>2} {r['dtype']:>5} {r['persistent_params']:>10} {r['expected_bytes'] / mb:>11.2f} "
                  f"{r['ratio_to_expected']:>24.4f} {r['peak_gathered_fwd_bytes'] / mb:>11.2f} "
                  f"{r['two_largest_units_bytes'] / mb:>18.2f} {r['n_units']:>5}")
    fs = [r for r in rows if r["stage"] == "fsdp2"]
    if fs:
        print("\nFSDP2 peak unsharded parameter bytes in forward (sampled at module hooks)")
        for r in fs:
            print(f"{r['world']:>2} {r['dtype']:>5} peak fwd {r['peak_gathered_fwd_bytes'] / mb:.2f} MB, "
                  f"2 largest units {r['two_largest_units_bytes'] / mb:.2f} MB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "rows": rows}, f, indent=2)
        print(f"wrote {args.out}")
    if args.plot and plot(rows, args.plot):
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
