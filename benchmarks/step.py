"""Time per training step: zerocore stages 0-3 beside PyTorch DDP and FSDP2 (``fully_shard``), and
on GPUs torch AMP and DeepSpeed, on the same model, the same ranks and the same batches, in one run.

On GPUs (``--device cuda``): one NCCL rank per GPU (``--ranks 1`` or ``--ranks all``), bf16
everywhere (torch AMP: fp32 parameters, bf16 autocast, fused AdamW; FSDP2: bf16 parameters, fp32
reduction; zerocore and DeepSpeed: ``bf16.enabled``), each variant built, run and freed in turn;
median step, tokens/s, peak memory over the timed steps and memory held between steps. Models:
``--model gpt`` (zerocore.demo.TinyGPT), ``hf-gpt2`` / ``hf-llama`` (Hugging Face, from configs).
The H100 table of benchmarks/results/gpu_h100_2026-11-22 corresponds to
``--device cuda --vocab 32768 --dim 1024 --layers 24 --heads 16 --ctx 1024 --batch 8``. Variants
live in step_variants.py (a registry: add one with ``@variant``).

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
    python benchmarks/step.py --device cuda --ranks all --model hf-llama --dim 1024 --layers 16 --ctx 512 --batch 4
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

import step_variants as sv  # noqa: E402

VARIANTS = list(sv.REGISTRY)


def build(variant: str, args, vocab: int, ctx: "sv.Ctx"):
    model = sv.build_model(args.model, args, vocab).to(ctx.device)
    return sv.REGISTRY[variant].build(model, ctx)


def _timed_cuda(step, batches, args, device) -> tuple[list[float], list[float], dict]:
    """A GPU variant alone: warm-up, then --steps x --rounds steps, each between two
    synchronizations; peak memory over the timed steps, memory held after the last one."""
    for i in range(args.warmup):
        b = batches[i % len(batches)]
        step(b[:, :-1], b[:, 1:])
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for i in range(args.steps * args.rounds):
        b = batches[i % len(batches)]
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = step(b[:, :-1], b[:, 1:])
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    gib = float(1 << 30)
    mem = {"peak_GiB": torch.cuda.max_memory_allocated(device) / gib,
           "between_steps_GiB": torch.cuda.memory_allocated(device) / gib}
    return times, losses, mem


def worker(rank: int, world: int, init: str, args, out: str) -> None:
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    ctx = sv.Ctx(device=device, world=world, args=args)
    vocab = args.vocab
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, (args.batch, args.ctx + 1), generator=gen).to(device) for _ in range(4)]
    n_params = sum(p.numel() for p in sv.build_model(args.model, args, vocab).parameters())
    times = {v: [] for v in args.variants}  # [round][step] seconds
    losses = {v: [] for v in args.variants}
    memory = {}
    if cuda:  # one variant at a time: large models do not fit twice
        for v in args.variants:
            flat, losses[v], memory[v] = _timed_cuda(build(v, args, vocab, ctx), batches, args, device)
            times[v] = [flat[r * args.steps:(r + 1) * args.steps] for r in range(args.rounds)]
            torch.cuda.empty_cache()
            dist.barrier()
    else:  # all built, then interleaved rounds against the VM's drift
        steps = {v: build(v, args, vocab, ctx) for v in args.variants}
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
            json.dump({"times": times, "losses": losses, "memory": memory, "n_params": n_params}, f)
    dist.destroy_process_group()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: gloo ranks, fp32; cuda: one NCCL rank per GPU, bf16 (torch AMP, FSDP2 mixed precision)")
    ap.add_argument("--ranks", default=None,
                    help="ranks (default 2 on cpu, 1 on cuda); on cuda 'all' = every GPU of the machine")
    ap.add_argument("--model", default="gpt", choices=sv.MODELS,
                    help="gpt: zerocore.demo.TinyGPT; hf-gpt2 / hf-llama: Hugging Face models from configs")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 65 on cpu, 32768 on cuda)")
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
    ap.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                    help="default: every variant that runs on the device and whose package is installed")
    ap.add_argument("--out", help="JSON file for the results")
    args = ap.parse_args(argv)
    if args.ranks is None:
        args.ranks = 1 if args.device == "cuda" else 2
    elif args.ranks == "all":
        if args.device != "cuda":
            ap.error("--ranks all needs --device cuda")
        args.ranks = torch.cuda.device_count()
    else:
        try:
            args.ranks = int(args.ranks)
        except ValueError:
            ap.error(f"--ranks must be a number or 'all', got {args.ranks!r}")
    if args.ranks < 1:
        ap.error(f"--ranks must be >= 1 (got {args.ranks}; on cuda: no GPU found?)")
    if args.device == "cuda" and args.ranks > torch.cuda.device_count():
        ap.error(f"--ranks {args.ranks} needs {args.ranks} GPUs; torch sees {torch.cuda.device_count()}")
    if args.vocab is None:
        args.vocab = 32768 if args.device == "cuda" else 65
    wanted = args.variants or (sv.CUDA_DEFAULT if args.device == "cuda" else sv.CPU_DEFAULT)
    args.skipped = {v: why for v in wanted if (why := sv.unavailable(v, args.device))}
    if args.variants and args.skipped:
        ap.error("; ".join(f"{v} {why}" for v, why in args.skipped.items()))
    args.variants = [v for v in wanted if v not in args.skipped]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    res = spawn_ranks(worker, args.ranks, args)
    flat = {v: [t for rnd in res["times"][v] for t in rnd] for v in args.variants}
    med = {v: statistics.median(flat[v]) for v in args.variants}
    rows = {}
    cuda = args.device == "cuda"
    print(f"{res['n_params'] / 1e6:.1f}M-param {args.model} (dim {args.dim}, {args.layers} layers, ctx {args.ctx}), "
          f"{args.ranks} ranks x {args.batch} sequences, " +
          ("bf16, NCCL, one variant at a time" if cuda else "fp32, gloo, 1 thread/rank") +
          f"; {args.rounds} {'' if cuda else 'interleaved '}rounds x {args.steps} steps")
    for v, why in args.skipped.items():
        print(f"  skipped {v}: {why}")
    tokens = args.ranks * args.batch * args.ctx
    print(f"{'variant':<24}{'median ms':>10}{'min':>8}{'p25':>8}{'p75':>8}{'max':>8}{'tokens/s':>11}{'peak GiB':>9}"
          f"{'held GiB':>9}")
    for v in args.variants:
        s = summary(flat[v])
        q = statistics.quantiles(flat[v], n=4) if len(flat[v]) > 1 else [flat[v][0]] * 3
        s["p25_ms"], s["p75_ms"] = q[0] * 1e3, q[2] * 1e3
        s["final_loss"] = res["losses"][v][-1]
        s["times_ms"] = [[round(t * 1e3, 2) for t in rnd] for rnd in res["times"][v]]
        s["tokens_per_s"] = tokens / (s["median_ms"] / 1e3)
        mem = res["memory"].get(v, {})  # GPU only: the CPU has no allocator statistics to read
        s["peak_GiB"], s["between_steps_GiB"] = mem.get("peak_GiB"), mem.get("between_steps_GiB")
        rows[v] = s
        fmt = lambda x: f"{x:>9.2f}" if x is not None else f"{'-':>9}"  # noqa: E731
        print(f"{v:<24}{s['median_ms']:>10.1f}{s['min_ms']:>8.1f}{s['p25_ms']:>8.1f}{s['p75_ms']:>8.1f}"
              f"{s['max_ms']:>8.1f}{s['tokens_per_s']:>11.0f}{fmt(s['peak_GiB'])}{fmt(s['between_steps_GiB'])}")
    # Ratios: of the overall medians, and per round (the two variants' medians within one round,
    # minutes apart at most), whose min/median/max is the spread.
    ratios = {}
    bases = ("torch_amp", "ddp_torch_adamw", "ddp_fused_adam", "fsdp2")
    pairs = [(a, b) for a in args.variants for b in bases
             if a != b and b in args.variants and a not in bases[:3]]
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
    # offload: against the same stage without offload, and against DeepSpeed's same configuration
    pairs += [(a, b) for a in args.variants if a.endswith("_offload")
              for b in (a[:-len("_offload")], a.replace("zerocore", "deepspeed"))
              if a != b and b in args.variants]
    if "zerocore_stage3" in args.variants and "zerocore_stage3_nocheck" in args.variants:
        d = med["zerocore_stage3"] - med["zerocore_stage3_nocheck"]
        print(f"divergence guard: {d * 1e3:+.1f} ms per step (difference of medians)")
    report = {"machine": machine_info(), "device": args.device, "gpu": torch.cuda.get_device_name(0) if cuda else None,
              "world": args.ranks, "args": vars(args), "n_params": res["n_params"], "results": rows, "ratios": ratios}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
