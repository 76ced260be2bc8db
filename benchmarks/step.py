"""Time per training step: zerocore stages 0-3 beside PyTorch DDP and FSDP2 (``fully_shard``), and
on GPUs torch AMP and DeepSpeed, on the same model, the same ranks and the same batches, in one run.

On GPUs (``--device cuda``): one NCCL rank per GPU (``--ranks 1`` or ``--ranks all``), bf16
everywhere (torch AMP: fp32 parameters, bf16 autocast, fused AdamW; FSDP2: bf16 parameters, fp32
reduction; zerocore and DeepSpeed: ``bf16.enabled``), each variant built, run, torn down and
checked to have given its memory back in turn (step_cuda.py: a variant that fails to build or
run, out of memory say, is skipped with its error); median step, tokens/s, peak memory over the
timed steps and memory held between steps, both net of what was allocated before the variant was
built, and what it left allocated after its teardown before and after ``gc.collect()``. Models:
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

CPU offload (``--preset offload``): after its timed steps each zerocore offload variant's host Adam
is timed alone on copies of its shards with its worker's thread count (T_host, host_step_probe.py);
the table sets the offload step against max(T_device, T_host), T_device being the same stage
without offload in the same run (1.0: host and device fully overlapped), and against their sum
(1.0: no overlap). On CUDA every rank's training thread gets its share of the cores (DeepSpeed's CPU
Adam runs with it); zerocore's host step takes its own count (zerocore/offload/host_threads.py).

NVMe offload (``--preset nvme``): zerocore and DeepSpeed stage 3 with the optimizer
state (``*_nvme``) and also the parameter shards beyond ``--max-in-cpu`` (``*_nvme_param``) in swap
files under ``--nvme-dir``, the same ``sub_group_size`` and ``aio`` section for both, beside stage 3
in memory and DDP. A variant a library refuses or fails to build is reported as skipped with its
error, the others run. Before every round rank 0 measures what the disk allows with the same aio
settings (the raw engine and fio writing and reading ``--disk-probe-mb``); swap_probe.py counts
zerocore's swap bytes and pass times per step from the benchmark side, and the table sets them
against the disk: ``io/disk`` = the time the disk needs for the step's bytes at the probed rates /
the swap passes' time (DeepSpeed's swapper is not instrumented: its rows have step times only).

    python benchmarks/step.py --ranks 2 --out benchmarks/results/step_gloo_w2.json
    python benchmarks/step.py --preset nvme --aio-block-size 262144 --aio-queue-depth 32 --aio-threads 2
    python benchmarks/step.py --device cuda --ranks all --model hf-llama --dim 1024 --layers 16 --ctx 512 --batch 4
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import gather_objects, machine_info, paired_by_round, summary, spawn_ranks  # noqa: E402

import step_cuda  # noqa: E402
import host_step_probe  # noqa: E402
import step_variants as sv  # noqa: E402
import swap_probe  # noqa: E402

VARIANTS = list(sv.REGISTRY)
# a GPU variant's memory in the JSON: the absolute baseline, then the figures net of it (step_cuda.py)
MEMORY_KEYS = ("baseline_GiB", "peak_GiB", "between_steps_GiB", "left_after_del_GiB", "left_after_gc_GiB", "pinned_GiB",
               "host_GiB")


def build(variant: str, args, vocab: int, ctx: "sv.Ctx"):
    model = sv.build_model(args.model, args, vocab).to(ctx.device)
    return sv.REGISTRY[variant].build(model, ctx)


def _rank_cores() -> int:
    try:
        from zerocore.offload.host_threads import cores_of_this_rank
    except ImportError:  # a zerocore from before it (compare_trees.py runs this script against older trees)
        return os.cpu_count() or 1
    return cores_of_this_rank()


def worker(rank: int, world: int, init: str, args, out: str) -> None:
    cuda = args.device == "cuda"
    # CPU: the ranks share this machine's cores, one thread each. CUDA: a rank's share of the cores
    # (what a rank started by DeepSpeed's launcher has; DeepSpeed's CPU Adam runs with it), not
    # torchrun's OMP_NUM_THREADS=1; zerocore's host step takes its own count (offload/host_threads.py)
    torch.set_num_threads(_rank_cores() if cuda else 1)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    ctx = sv.Ctx(device=device, world=world, args=args)
    vocab = args.vocab
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, vocab, (args.batch, args.ctx + 1), generator=gen).to(device) for _ in range(4)]
    n_params = sum(p.numel() for p in sv.build_model(args.model, args, vocab).parameters())
    if cuda and args.interleave:  # every variant at once, rounds interleaved (short, host-bound steps)
        res = step_cuda.run_interleaved(args.variants, lambda v: build(v, args, vocab, ctx), batches, args,
                                        step_cuda.CudaMemory(device), rank, world)
    elif cuda:  # one variant at a time: large models do not fit twice
        res = step_cuda.run_variants(args.variants, lambda v: build(v, args, vocab, ctx), batches, args,
                                     step_cuda.CudaMemory(device), rank, world)
    else:
        res = _run_cpu(rank, world, args, vocab, ctx, batches)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({**res, "n_params": n_params}, f)
    dist.destroy_process_group()


def _run_cpu(rank: int, world: int, args, vocab: int, ctx: "sv.Ctx", batches) -> dict:
    """All variants built, then interleaved rounds against the VM's drift; each torn down at the end."""
    probe = swap_probe.SwapProbe()
    nvme = [v for v in args.variants if "_nvme" in v]
    if nvme:
        probe.install()
    steps, not_built = {}, {}
    for v in args.variants:
        probe.tag = v
        try:
            steps[v] = build(v, args, vocab, ctx)
        except Exception as e:  # noqa: BLE001 - a configuration a library refuses or fails here: say why, go on
            not_built[v] = f"failed to build: {type(e).__name__}: {e}"
    agreed = {}  # every rank skips the same variants (one rank's refusal alone would hang the others)
    for d in gather_objects(not_built, world):
        agreed.update(d)
    for v in [v for v in steps if v in agreed]:  # built here, refused on another rank
        steps.pop(v).close(failed=True)
    times = {v: [] for v in steps}  # [round][step] seconds
    losses = {v: [] for v in steps}
    disk = []
    for v in steps:  # warm-up
        for i in range(args.warmup):
            b = batches[i % len(batches)]
            steps[v](b[:, :-1], b[:, 1:])
    for r in range(args.rounds):
        if nvme and args.disk_probe_mb:  # what the disk allows, between the rounds of the same run
            if rank == 0:
                disk.append(swap_probe.disk_probe(args.nvme_dir, args.disk_probe_mb << 20, sv.aio_section(args)))
            dist.barrier()
        order = list(steps)
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
    swap = gather_objects(probe.snapshot(), world)  # the timed steps' swap, before the teardown's
    memory = {}  # the CPU has no allocator statistics to read: only the offload variants' T_host
    for v, step in steps.items():
        t_host = host_step_probe.host_step_seconds(getattr(step, "engine", None))
        if t_host is not None:
            memory[v] = {"host_step": t_host}
    for v in list(steps):  # in the same order on every rank: a teardown may be collective (stage 3's gather)
        steps.pop(v).close()
    if rank == 0 and disk:
        os.remove(os.path.join(args.nvme_dir, swap_probe.PROBE_FILE))
    return {"times": times, "losses": losses, "memory": memory, "not_built": agreed, "disk": disk, "swap": swap}


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
    ap.add_argument("--interleave", action="store_true",
                    help="cuda: build every variant first and interleave the rounds in a fresh order each (as on the "
                         "CPU), for short host-bound steps whose time drifts with the host; memory per run, not per "
                         "variant")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="cuda: after each variant's timed steps, profile --profile-steps more with torch.profiler "
                         "(DIR/profile_<variant>.txt, DIR/trace_<variant>.json.gz; per-step device busy time, "
                         "launches, blocking calls in the JSON and a table)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--preset", choices=sorted(sv.PRESETS), default=None,
                    help="a named list of variants instead of --variants (offload: CPU offload, nvme: NVMe offload, "
                         "face: zerocore.deepspeed with groups and a schedule, a client SGD)")
    nv = ap.add_argument_group("NVMe variants (*_nvme*): the same settings for zerocore and DeepSpeed")
    nv.add_argument("--nvme-dir", default=None,
                    help="where the swap files go (default: a fresh folder under the temp dir; removed at the end)")
    nv.add_argument("--sub-group", type=float, default=1e6, help="sub_group_size (elements per swap tile)")
    nv.add_argument("--buffer-count", type=int, default=4,
                    help="offload_optimizer.buffer_count of zerocore (a buffer = one tile's master, m and v)")
    nv.add_argument("--ds-buffer-count", type=int, default=16,
                    help="offload_optimizer.buffer_count of DeepSpeed (a buffer = one tensor of a sub-group; "
                         "4 and 8 run out of buffers here with pipelining on)")
    nv.add_argument("--max-in-cpu", type=float, default=1e6,
                    help="offload_param.max_in_cpu (elements of parameter shards kept in host memory)")
    nv.add_argument("--param-buffer", type=float, default=4e6,
                    help="offload_param.buffer_size (DeepSpeed: at least the largest sub-group)")
    nv.add_argument("--aio-block-size", type=int, default=1 << 20)
    nv.add_argument("--aio-queue-depth", type=int, default=8)
    nv.add_argument("--aio-threads", type=int, default=1)
    nv.add_argument("--disk-probe-mb", type=int, default=256,
                    help="MB the raw engine (and fio) write and read before every round, with the same aio "
                         "settings (0: skip)")
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
    if args.preset:
        if args.variants:
            ap.error("--preset and --variants: give one")
        args.variants = sv.PRESETS[args.preset]
    wanted = args.variants or (sv.CUDA_DEFAULT if args.device == "cuda" else sv.CPU_DEFAULT)
    args.skipped = {v: why for v in wanted if (why := sv.unavailable(v, args.device))}
    # Variants named one by one must all run; a preset or the default list drops the peers that
    # cannot run here (a library not installed, another device) and says which and why.
    if args.variants and args.skipped and not args.preset:
        ap.error("; ".join(f"{v} {why}" for v, why in args.skipped.items()))
    if args.preset:
        for v, why in args.skipped.items():
            print(f"step.py: preset {args.preset}: leaving out {v}: {why}", file=sys.stderr)
    args.variants = [v for v in wanted if v not in args.skipped]
    return args


def _without_offload(name: str) -> str:
    return name.split("_offload")[0].split("_nvme")[0]


def nvme_report(res: dict, args, med: dict) -> dict:
    """The NVMe variants' swap per step against what the disk allowed in the same run: the raw
    engine's write and read GB/s (median of the probes between rounds) give the time the disk needs
    at best for the step's bytes (reads then writes); ``io_vs_disk`` = that time / the swap passes'
    time per step (1.0: the swap moves at the disk's best rate)."""
    disk = res.get("disk") or []
    out = {"nvme_dir": args.nvme_dir, "filesystem": swap_probe.fs_of(args.nvme_dir), "aio": sv.aio_section(args),
           "disk_probes": disk, "variants": {}}
    for key in ("engine_write_GBps", "engine_read_GBps", "fio_write_GBps", "fio_read_GBps"):
        vals = [d[key] for d in disk if d.get(key)]
        out[key] = statistics.median(vals) if vals else None
    print(f"\nNVMe ({out['filesystem']}, aio {out['aio']}): disk probes of {args.disk_probe_mb} MB before each round, "
          "medians: " + ", ".join(f"{k[:-5].replace('_', ' ')} {out[k]:.2f} GB/s" for k in
                                  ("engine_write_GBps", "engine_read_GBps", "fio_write_GBps", "fio_read_GBps")
                                  if out[k]))
    print(f"{'variant (zerocore swap, all ranks)':<36}{'read MB':>9}{'write MB':>9}{'io pass ms':>11}{'blocked ms':>11}"
          f"{'disk ms':>9}{'io/disk':>8}{'io/step':>8}")
    for v in args.variants:
        if "_nvme" not in v:
            continue
        row = swap_probe.per_step(res.get("swap", []), v)
        if row is None:  # DeepSpeed's swapper is not instrumented
            continue
        if out["engine_write_GBps"] and out["engine_read_GBps"]:
            row["disk_s"] = row["read_bytes"] / out["engine_read_GBps"] / 1e9 + \
                row["write_bytes"] / out["engine_write_GBps"] / 1e9
            row["io_vs_disk"] = row["disk_s"] / row["io_pass_s"]
        row["io_pass_share_of_step"] = row["io_pass_s"] / med[v]
        out["variants"][v] = row
        f = lambda k, scale=1e3: f"{row[k] * scale:.1f}" if k in row else "-"  # noqa: E731
        print(f"{v:<36}{row['read_bytes'] / 1e6:>9.1f}{row['write_bytes'] / 1e6:>9.1f}{f('io_pass_s'):>11}"
              f"{f('blocked_s'):>11}{f('disk_s'):>9}{f('io_vs_disk', 1):>8}{row['io_pass_share_of_step']:>8.2f}")
    return out


def profile_table(res: dict, args, rows: dict) -> None:
    """The --profile figures (step_profile.py) per variant, into the rows and a table."""
    prof = {v: res["memory"].get(v, {}).get("profile") for v in args.variants}
    prof = {v: p for v, p in prof.items() if p}
    if not prof:
        return
    print(f"\n{'profiled (' + str(args.profile_steps) + ' steps, per step)':<36}{'wall ms':>9}{'busy ms':>9}"
          f"{'idle':>7}{'launches':>9}  blocking calls / memcpys")
    for v, p in prof.items():
        rows[v]["profile"] = p
        if "error" in p:
            print(f"{v:<36}{p['error']}")
            continue
        extra = ", ".join(f"{k} {n:g}" for k, n in {**p["blocking_calls"], **p["memcpy"]}.items()) or "-"
        print(f"{v:<36}{p['wall_ms']:>9.1f}{p['device_busy_ms']:>9.1f}{p['device_idle_share']:>7.2f}"
              f"{p['launches']:>9.0f}  {extra}")


def offload_bounds(res: dict, args, med: dict, rows: dict) -> dict:
    """Each zerocore CPU-offload variant's step against what it could take at best: T_host (its host
    Adam alone, host_step_probe.py) and T_device (the same stage without offload, this run's median).
    ``vs_max`` = step / max(T_device, T_host) (1.0: the host step fully hidden under the device's
    work or the other way round); ``vs_sum`` = step / (T_device + T_host) (1.0: no overlap at all)."""
    out = {}
    for v in args.variants:
        t = res["memory"].get(v, {}).get("host_step")
        if not t or "median_ms" not in t:
            continue
        rows[v]["host_step"] = t
        dev = _without_offload(v)
        t_dev = med[dev] * 1e3 if dev in med and dev != v else None
        row = {"step_ms": med[v] * 1e3, "t_host_ms": t["median_ms"], "t_device_ms": t_dev, "host_threads": t["threads"]}
        if t_dev is not None:
            row["vs_max"] = row["step_ms"] / max(t_dev, t["median_ms"])
            row["vs_sum"] = row["step_ms"] / (t_dev + t["median_ms"])
        out[v] = row
    if out:
        print(f"\n{'offload step against T_host and T_device':<36}{'step ms':>9}{'T_host':>9}{'threads':>8}"
              f"{'T_device':>9}{'vs max':>8}{'vs sum':>8}")
        for v, r in out.items():
            f = lambda k, p=1: f"{r[k]:.{p}f}" if r.get(k) is not None else "-"  # noqa: E731
            print(f"{v:<36}{f('step_ms'):>9}{f('t_host_ms'):>9}{r['host_threads']:>8}{f('t_device_ms'):>9}"
                  f"{f('vs_max', 2):>8}{f('vs_sum', 2):>8}")
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    made_dir = args.nvme_dir is None
    if made_dir:
        args.nvme_dir = tempfile.mkdtemp(prefix="zc_step_nvme_")
    try:
        res = spawn_ranks(worker, args.ranks, args)
    finally:
        if made_dir:
            shutil.rmtree(args.nvme_dir, ignore_errors=True)
    for v, why in res.get("not_built", {}).items():
        args.skipped[v] = why
    args.variants = [v for v in args.variants if v not in args.skipped]
    flat = {v: [t for rnd in res["times"][v] for t in rnd] for v in args.variants}
    med = {v: statistics.median(flat[v]) for v in args.variants}
    rows = {}
    cuda = args.device == "cuda"
    print(f"{res['n_params'] / 1e6:.1f}M-param {args.model} (dim {args.dim}, {args.layers} layers, ctx {args.ctx}), "
          f"{args.ranks} ranks x {args.batch} sequences, " +
          (f"bf16, NCCL, {'variants interleaved' if args.interleave else 'one variant at a time'}" if cuda
           else "fp32, gloo, 1 thread/rank") +
          f"; {args.rounds} {'' if cuda else 'interleaved '}rounds x {args.steps} steps")
    for v, why in args.skipped.items():
        print(f"  skipped {v}: {why}")
    tokens = args.ranks * args.batch * args.ctx
    if cuda:
        print("memory: GiB net of each variant's baseline (allocated before it was built: the batches); "
              "left/del: still allocated after its close() and del, left/gc: after gc.collect() too; pinned: page-locked "
              "host memory it holds, host: the process's resident host memory beyond the baseline (RSS)")
    print(f"{'variant':<24}{'median ms':>10}{'min':>8}{'p25':>8}{'p75':>8}{'max':>8}{'tokens/s':>11}{'peak GiB':>9}"
          f"{'held GiB':>9}{'left/del':>9}{'left/gc':>9}{'pinned':>9}{'host':>9}")
    for v in args.variants:
        s = summary(flat[v])
        q = statistics.quantiles(flat[v], n=4) if len(flat[v]) > 1 else [flat[v][0]] * 3
        s["p25_ms"], s["p75_ms"] = q[0] * 1e3, q[2] * 1e3
        s["final_loss"] = res["losses"][v][-1]
        s["times_ms"] = [[round(t * 1e3, 2) for t in rnd] for rnd in res["times"][v]]
        s["tokens_per_s"] = tokens / (s["median_ms"] / 1e3)
        mem = res["memory"].get(v, {})  # GPU only (rank 0's): the CPU has no allocator statistics to read
        s.update({k: mem.get(k) for k in MEMORY_KEYS}, **({"close_error": mem["close_error"]} if
                                                           mem.get("close_error") else {}))
        rows[v] = s
        fmt = lambda x: f"{x:>9.2f}" if x is not None else f"{'-':>9}"  # noqa: E731
        print(f"{v:<24}{s['median_ms']:>10.1f}{s['min_ms']:>8.1f}{s['p25_ms']:>8.1f}{s['p75_ms']:>8.1f}"
              f"{s['max_ms']:>8.1f}{s['tokens_per_s']:>11.0f}" + "".join(fmt(s[k]) for k in MEMORY_KEYS[1:]))
    run = res["memory"].get("run")
    if run:  # --interleave: the figures are the run's (every variant alive at once)
        print("run (every variant at once): " + ", ".join(f"{k.replace('_GiB', '')} {x:.2f} GiB" for k, x in run.items()))
    for v, mem in res["memory"].items():  # again after the table, where it is read: memory not given back
        for line in step_cuda.leak_warnings(v, mem):
            print(line)
    # Ratios: of the overall medians, and per round (the two variants' medians within one round,
    # minutes apart at most), whose min/median/max is the spread.
    ratios = {}
    bases = ("torch_amp", "ddp_torch_adamw", "ddp_fused_adam", "fsdp2")
    pairs = [(a, b) for a in args.variants for b in bases
             if a != b and b in args.variants and a not in bases[:3]]
    # offload (CPU or NVMe): against the same stage without offload, and DeepSpeed's same configuration
    pairs += [(a, b) for a in args.variants if a.startswith("zerocore") and ("_offload" in a or "_nvme" in a)
              for b in (_without_offload(a), a.replace("zerocore", "deepspeed"))
              if a != b and b in args.variants]
    if "zerocore_stage3" in args.variants and "zerocore_stage3_nocheck" in args.variants:
        pairs.append(("zerocore_stage3", "zerocore_stage3_nocheck"))
    # the DeepSpeed face: against the native engine's same stage; its client SGD against DDP's SGD
    pairs += [(a, a.replace("face_", "")) for a in args.variants
              if a.startswith("zerocore_face_stage") and a.replace("face_", "") in args.variants]
    if "zerocore_face_sgd_stage2" in args.variants and "ddp_torch_sgd" in args.variants:
        pairs.append(("zerocore_face_sgd_stage2", "ddp_torch_sgd"))
    if pairs:
        print(f"\n{'ratio (median step time)':<52}{'overall':>9}{'per-round min':>15}{'median':>8}{'max':>8}")
    for a, b in pairs:
        r = {"overall": med[a] / med[b], **paired_by_round(res["times"][a], res["times"][b])}
        ratios[f"{a}/{b}"] = r
        print(f"{a + ' / ' + b:<52}{r['overall']:>8.3f}x{r['round_min']:>14.3f}x{r['round_median']:>7.3f}x"
              f"{r['round_max']:>7.3f}x")
    profile_table(res, args, rows)
    bounds = offload_bounds(res, args, med, rows)
    if "zerocore_stage3" in args.variants and "zerocore_stage3_nocheck" in args.variants:
        d = med["zerocore_stage3"] - med["zerocore_stage3_nocheck"]
        print(f"divergence guard: {d * 1e3:+.1f} ms per step (difference of medians)")
    report = {"machine": machine_info(), "device": args.device, "gpu": torch.cuda.get_device_name(0) if cuda else None,
              "world": args.ranks, "args": vars(args), "n_params": res["n_params"], "results": rows, "ratios": ratios,
              "skipped": {v: {"why": why, **res["memory"].get(v, {})} for v, why in args.skipped.items()}}
    if bounds:
        report["offload_bounds"] = bounds
    if res.get("disk") or any("_nvme" in v for v in args.variants):
        report["nvme"] = nvme_report(res, args, med)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
