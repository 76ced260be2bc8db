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

zerocore stage 3 is wrapped the same way: one unit per ``Block`` (``stage3_unit_classes``) plus
the root (embeddings, tied head); parameters under ``--persist`` elements (LayerNorms, biases)
stay whole on every rank, the matrices are partitioned; ``stage3_prefetch_bucket_size`` = one
block's partitioned elements (prefetch one block ahead). ``zerocore_stage3_nocheck`` is the same
with ``stage3_check_divergence: false``: the difference is the divergence guard's cost.

    python benchmarks/step.py --ranks 2 --out benchmarks/results/step_gloo_w2.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, summary, spawn_ranks  # noqa: E402

VARIANTS = ["ddp_torch_adamw", "ddp_fused_adam", "fsdp2", "zerocore_stage0", "zerocore_stage1", "zerocore_stage2",
            "zerocore_stage3", "zerocore_stage3_nocheck"]
# CPU offload (issue 12): zerocore's beside DeepSpeed's same configurations (when importable)
OFFLOAD_VARIANTS = ["zerocore_stage2_offload", "zerocore_stage3_offload", "deepspeed_stage2",
                    "deepspeed_stage2_offload", "deepspeed_stage3_offload"]


def stage3_config(model, persist: int) -> dict:
    """Stage 3 wrapped like FSDP2 here: a unit per Block + the root, prefetch one block ahead."""
    block = model.blocks[0]
    block_elems = sum(p.numel() for p in block.parameters() if p.numel() >= persist)
    return {"stage3_unit_classes": ["Block"], "stage3_param_persistence_threshold": persist,
            "stage3_prefetch_bucket_size": block_elems}


def torch_step(model, opt):
    """One training step of a torch-wrapped model (DDP, FSDP2) with a torch-style optimizer."""
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


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

        return torch_step(ddp, opt)
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)

        return torch_step(model, opt)
    if variant.startswith("deepspeed"):
        return deepspeed_step(variant, model, args, lr, wd)
    stage = int(variant[len("zerocore_stage")])
    z = {"stage": stage, "reduce_bucket_size": int(args.bucket), "overlap_comm": True}
    if stage == 3:
        z.update(stage3_config(model, args.persist), stage3_check_divergence=not variant.endswith("_nocheck"))
    add_offload(z, variant, stage)
    engine = zerocore.initialize(model, {
        "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": wd}},
        "zero_optimization": z})
    return engine_step(engine)


def engine_step(engine):
    """One training step of a ZeRO engine (zerocore's or DeepSpeed's: the same three calls)."""
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        return loss
    return step


def add_offload(z: dict, variant: str, stage: int) -> None:
    """The *_offload variants: the optimizer state and step on the host; stage 3: parameters too (the
    same keys for zerocore and DeepSpeed)."""
    if variant.endswith("_offload"):
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            z["offload_param"] = {"device": "cpu", "pin_memory": True}


def deepspeed_step(variant: str, model, args, lr: float, wd: float):
    """DeepSpeed's engine on the same model, gloo, its CPU accelerator; offload variants use its
    offload_optimizer (and offload_param at stage 3) device cpu, which steps with DeepSpeedCPUAdam."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # one machine: the local rank is the rank
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    import deepspeed

    stage = int(variant[len("deepspeed_stage")])
    z = {"stage": stage, "reduce_bucket_size": int(args.bucket), "overlap_comm": True}
    if stage == 3:
        z.update(stage3_param_persistence_threshold=args.persist,
                 stage3_prefetch_bucket_size=stage3_config(model, args.persist)["stage3_prefetch_bucket_size"])
    add_offload(z, variant, stage)
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": wd}}, "zero_optimization": z,
           "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine_step(engine)


def worker(rank: int, world: int, init: str, args, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    vocab = 65
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, (args.batch, args.ctx + 1), generator=gen) for _ in range(4)]
    steps = {v: build(v, args, vocab) for v in args.variants}
    n_params = sum(p.numel() for p in __import__("zerocore.demo", fromlist=["TinyGPT"]).TinyGPT(
        vocab, args.dim, args.layers, heads=args.heads, ctx=args.ctx).parameters())
    times = {v: [] for v in args.variants}  # [round][step] seconds
    losses = {v: [] for v in args.variants}
    for v in args.variants:  # warm-up
        for i in range(args.warmup):
            b = batches[i % len(batches)]
            steps[v](b[:, :-1], b[:, 1:])
    for r in range(args.rounds):
        order = list(args.variants)
        random.Random(r).shuffle(order)  # a fresh order each round, the same on every rank
        for v in order:
            dist.barrier()
            times[v].append([])
            for i in range(args.steps):
                b = batches[i % len(batches)]
                t0 = time.perf_counter()
                loss = steps[v](b[:, :-1], b[:, 1:])
                times[v][-1].append(time.perf_counter() - t0)
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
    ap.add_argument("--persist", type=int, default=10_000,
                    help="stage 3: stage3_param_persistence_threshold (LayerNorms/biases whole, matrices partitioned)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS + OFFLOAD_VARIANTS)
    ap.add_argument("--out", help="JSON file for the results")
    args = ap.parse_args()
    res = spawn_ranks(worker, args.ranks, args)
    flat = {v: [t for rnd in res["times"][v] for t in rnd] for v in args.variants}
    med = {v: statistics.median(flat[v]) for v in args.variants}
    rows = {}
    print(f"{res['n_params'] / 1e6:.1f}M-param GPT (dim {args.dim}, {args.layers} layers, ctx {args.ctx}), "
          f"{args.ranks} ranks x {args.batch} sequences, fp32, gloo, 1 thread/rank; "
          f"{args.rounds} interleaved rounds (random order) x {args.steps} steps")
    print(f"{'variant':<24}{'median ms':>10}{'min':>8}{'p25':>8}{'p75':>8}{'max':>8}")
    for v in args.variants:
        s = summary(flat[v])
        q = statistics.quantiles(flat[v], n=4) if len(flat[v]) > 1 else [flat[v][0]] * 3
        s["p25_ms"], s["p75_ms"] = q[0] * 1e3, q[2] * 1e3
        s["final_loss"] = res["losses"][v][-1]
        s["times_ms"] = [[round(t * 1e3, 2) for t in rnd] for rnd in res["times"][v]]
        rows[v] = s
        print(f"{v:<24}{s['median_ms']:>10.1f}{s['min_ms']:>8.1f}{s['p25_ms']:>8.1f}{s['p75_ms']:>8.1f}"
              f"{s['max_ms']:>8.1f}")
    # Ratios: of the overall medians, and per round (the two variants' medians within one round,
    # minutes apart at most), whose min/median/max is the spread.
    ratios = {}
    pairs = [(a, b) for a in args.variants for b in ("ddp_torch_adamw", "ddp_fused_adam", "fsdp2")
             if a != b and b in args.variants and (a.startswith("zerocore") or a == "fsdp2")]
    # offload: against the same stage without offload, and against DeepSpeed's same configuration
    pairs += [(a, b) for a in args.variants if a.endswith("_offload")
              for b in (a[:-len("_offload")], a.replace("zerocore", "deepspeed"))
              if a != b and b in args.variants]
    if "zerocore_stage3" in args.variants and "zerocore_stage3_nocheck" in args.variants:
        pairs.append(("zerocore_stage3", "zerocore_stage3_nocheck"))
    if pairs:
        print(f"\n{'ratio (median step time)':<52}{'overall':>9}{'per-round min':>15}{'median':>8}{'max':>8}")
    for a, b in pairs:
        per_round = [statistics.median(x) / statistics.median(y) for x, y in zip(res["times"][a], res["times"][b])]
        r = {"overall": med[a] / med[b], "per_round": per_round, "round_min": min(per_round),
             "round_median": statistics.median(per_round), "round_max": max(per_round)}
        ratios[f"{a}/{b}"] = r
        print(f"{a + ' / ' + b:<52}{r['overall']:>8.3f}x{r['round_min']:>14.3f}x{r['round_median']:>7.3f}x"
              f"{r['round_max']:>7.3f}x")
    if "zerocore_stage3" in args.variants and "zerocore_stage3_nocheck" in args.variants:
        d = med["zerocore_stage3"] - med["zerocore_stage3_nocheck"]
        print(f"divergence guard: {d * 1e3:+.1f} ms per step (difference of medians)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "n_params": res["n_params"], "results": rows,
                       "ratios": ratios},
                      f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
