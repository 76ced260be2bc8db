"""Time per training step: zerocore stages 0/1/2 beside PyTorch DDP and FSDP2 (``fully_shard``)
on the same GPT, the same ranks and the same batches, in one run.

Protocol: every variant is built once (same seed), warmed up, then the variants take turns:
each round runs ``--steps`` timed steps of every variant in turn (interleaved against drift:
memory bandwidth on this VM moves up to 1.8x over 20 minutes), for ``--rounds`` rounds. A step
= forward + backward + optimizer step on one micro-batch per rank; rank 0's wall clock, the
ranks being in lock-step through their collectives. One thread per rank.

DDP is timed with torch.optim.AdamW (what DDP users run) and with zerocore's FusedAdam (the
same Adam kernel as the zerocore stages: the like-for-like baseline). FSDP2 wraps each block
and the root, with torch.optim.AdamW on its DTensor shards.

    python benchmarks/step.py --ranks 2 --out benchmarks/results/step_gloo_w2.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, summary, spawn_ranks  # noqa: E402

VARIANTS = ["ddp_torch_adamw", "ddp_fused_adam", "fsdp2", "zerocore_stage0", "zerocore_stage1", "zerocore_stage2"]


def build(variant: str, args, vocab: int):
    import zerocore
    from zerocore.demo import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab, args.dim, args.layers, heads=args.heads, ctx=args.ctx)
    lr, wd = 1e-3, 0.01
    if variant.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model)
        opt = (torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=wd) if variant == "ddp_torch_adamw"
               else zerocore.FusedAdam(ddp.parameters(), lr=lr, weight_decay=wd))

        def step(x, y):
            loss = torch.nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)

        def step(x, y):
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return step
    stage = int(variant[-1])
    engine = zerocore.initialize(model, {
        "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": wd}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": int(args.bucket), "overlap_comm": True}})

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        return loss
    return step


def worker(rank: int, world: int, init: str, args, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    vocab = 65
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, (args.batch, args.ctx + 1), generator=gen) for _ in range(4)]
    steps = {v: build(v, args, vocab) for v in args.variants}
    n_params = sum(p.numel() for p in __import__("zerocore.demo", fromlist=["TinyGPT"]).TinyGPT(
        vocab, args.dim, args.layers, heads=args.heads, ctx=args.ctx).parameters())
    times = {v: [] for v in args.variants}
    losses = {v: [] for v in args.variants}
    for v in args.variants:  # warm-up
        for i in range(args.warmup):
            b = batches[i % len(batches)]
            steps[v](b[:, :-1], b[:, 1:])
    for _ in range(args.rounds):
        for v in args.variants:
            dist.barrier()
            for i in range(args.steps):
                b = batches[i % len(batches)]
                t0 = time.perf_counter()
                loss = steps[v](b[:, :-1], b[:, 1:])
                times[v].append(time.perf_counter() - t0)
                losses[v].append(loss.item())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "losses": losses, "n_params": n_params}, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    ap.add_argument("--bucket", type=float, default=2.5e6, help="zerocore reduce_bucket_size (elements)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    ap.add_argument("--out", help="JSON file for the results")
    args = ap.parse_args()
    res = spawn_ranks(worker, args.ranks, args)
    base = statistics.median(res["times"]["ddp_torch_adamw"]) if "ddp_torch_adamw" in res["times"] else None
    like = statistics.median(res["times"]["ddp_fused_adam"]) if "ddp_fused_adam" in res["times"] else None
    rows = {}
    print(f"{res['n_params'] / 1e6:.1f}M-param GPT (dim {args.dim}, {args.layers} layers, ctx {args.ctx}), "
          f"{args.ranks} ranks x {args.batch} sequences, fp32, gloo, 1 thread/rank; "
          f"{args.rounds} interleaved rounds x {args.steps} steps")
    print(f"{'variant':<18}{'median ms':>10}{'min':>8}{'max':>8}{'vs DDP+AdamW':>14}{'vs DDP+Fused':>14}")
    for v in args.variants:
        s = summary(res["times"][v])
        s["vs_ddp_torch_adamw"] = s["median_ms"] / 1e3 / base if base else None
        s["vs_ddp_fused_adam"] = s["median_ms"] / 1e3 / like if like else None
        s["final_loss"] = res["losses"][v][-1]
        rows[v] = s
        f = (lambda x: f"{x:.3f}x" if x else "-")
        print(f"{v:<18}{s['median_ms']:>10.1f}{s['min_ms']:>8.1f}{s['max_ms']:>8.1f}"
              f"{f(s['vs_ddp_torch_adamw']):>14}{f(s['vs_ddp_fused_adam']):>14}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "n_params": res["n_params"], "results": rows},
                      f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
