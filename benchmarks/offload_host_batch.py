"""The optimizer step of stage 2 with CPU offload, each group's host Adam handed to the worker on its own
(``per_group``, as before zerocore/offload/host_batch.py) against consecutive groups stepped as one job
(``batched``, the default): many small groups (a small reduce_bucket_size) make the per-group hand-over show.
One rank, the host step on the worker thread (``ZEROCORE_HOST_STEP_THREADS``, as on a GPU); both engines built
from the same seed, their steps interleaved in a fresh order each round. Times ``engine.step()`` alone (the
host Adam, its hand-over and the copies back) and the whole training step.

    python benchmarks/offload_host_batch.py --out benchmarks/results/cpu_2026-11-26_issue35_stop41/offload_host_batch_cpu_2026-11-26.json
    python benchmarks/offload_host_batch.py --device cuda --dim 1024 --layers 24 --bucket 2.5e6 --threads 15
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import host_step_args, interleaved, machine_info, summary  # noqa: E402


def build(args, batched: bool):
    import zerocore
    import zerocore.runtime.engine as engine_module
    from zerocore.demo import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, ctx=args.ctx).to(args.device)
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 2, "reduce_bucket_size": int(args.bucket),
                                 "offload_optimizer": {"device": "cpu", "pin_memory": True}},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if args.device == "cuda":
        cfg["bf16"] = {"enabled": True}
    batchable = engine_module.batchable
    if not batched:
        engine_module.batchable = lambda shard: False
    try:
        return zerocore.initialize(model, cfg)
    finally:
        engine_module.batchable = batchable


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    host_step_args(ap, ctx=32, batch=2, bucket=5e4, rounds=20)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    os.environ["ZEROCORE_HOST_STEP_THREADS"] = str(args.threads)
    torch.set_num_threads(1)
    engines = {"per_group": build(args, False), "batched": build(args, True)}
    x = torch.randint(0, args.vocab, (args.batch, args.ctx + 1), device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def one(e) -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(e(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        e.backward(loss)
        sync()
        t1 = time.perf_counter()
        e.step()
        sync()
        t2 = time.perf_counter()
        return t2 - t1, t2 - t0

    timed = interleaved(engines, one, args.rounds, args.steps)
    opt = {k: [a for a, _ in v] for k, v in timed.items()}
    whole = {k: [b for _, b in v] for k, v in timed.items()}
    res = {"machine": machine_info(), "args": vars(args),
           "groups": len(engines["batched"].groups),
           "params": sum(p.numel() for p in engines["batched"].module.parameters()),
           "step_calls": {k: len(e._batches) for k, e in engines.items()},
           "optimizer_step": {k: summary(v) for k, v in opt.items()},
           "whole_step": {k: summary(v) for k, v in whole.items()}}
    res["batched_over_per_group"] = {w: res[w]["batched"]["median_ms"] / res[w]["per_group"]["median_ms"]
                                     for w in ("optimizer_step", "whole_step")}
    print(f"{res['params'] / 1e6:.1f}M parameters in {res['groups']} groups, stage 2 + CPU offload, {args.device}, "
          f"host step on the worker with {args.threads} thread(s); {args.rounds} interleaved rounds x {args.steps}")
    print(f"{'variant':<12}{'step() calls':>14}{'engine.step() ms':>18}{'whole step ms':>15}")
    for k in engines:
        print(f"{k:<12}{res['step_calls'][k]:>14}{res['optimizer_step'][k]['median_ms']:>18.2f}"
              f"{res['whole_step'][k]['median_ms']:>15.2f}")
    print("batched / per_group: engine.step() {optimizer_step:.3f}x, whole step {whole_step:.3f}x".format(
        **res["batched_over_per_group"]))
    for e in engines.values():
        e.destroy()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
