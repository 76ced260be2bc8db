"""Shared pieces of the microbenchmarks: machine facts, robust timing summaries, hugepage
advice, and a cache-flushing "cold" protocol."""
from __future__ import annotations

import ctypes
import json
import os
import platform
import random
import statistics
import tempfile

import torch

MADV_HUGEPAGE = 14


def machine_info() -> dict:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    thp = ""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read().strip()
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "thp_setting": thp}


def advise_hugepages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) on a tensor's pages (THP is madvise-only on this machine)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = 4096
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    a = (start + page - 1) // page * page
    length = (end // page * page) - a
    if length <= 0:
        return False
    return libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0


def paired_by_round(num: list[list[float]], den: list[list[float]]) -> dict:
    """Two variants timed in the same interleaved rounds (each a list of step times): each round's median of
    ``num`` over the same round's median of ``den`` (the drift between rounds cancels), and their range."""
    per_round = [statistics.median(a) / statistics.median(b) for a, b in zip(num, den)]
    return {"per_round": per_round, "round_min": min(per_round), "round_median": statistics.median(per_round),
            "round_max": max(per_round)}


def summary(times_s: list[float]) -> dict:
    ms = sorted(t * 1e3 for t in times_s)
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "n": len(ms),
            "spread_pct": 100.0 * (ms[-1] - ms[0]) / statistics.median(ms)}


class ColdFlusher:
    """Streams through a buffer larger than the caches before each timed step, so the step
    finds its own arrays cold, as in training where forward/backward ran in between."""

    def __init__(self, nbytes: int = 1 << 30):
        self.buf = torch.ones(nbytes // 4)

    def __call__(self) -> None:
        self.buf.mul_(1.0)


def init_rank(rank: int, world: int, init_file: str, device: str):
    """One spawned rank of a collective benchmark: one intra-op thread, NCCL on ``device ==
    "cuda"`` (this rank's GPU) else gloo, the process group through ``init_file``. Returns
    (the rank's torch.device, a function that waits for the device's queued work)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    if device == "cuda":
        return torch.device("cuda", rank), torch.cuda.synchronize
    return torch.device("cpu"), lambda: None


def collective_parser(doc: str, variants: list[str]):
    """The arguments every collective benchmark takes (--ranks, --iters, --device, --variants,
    --out); the caller adds its sizes."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--variants", nargs="+", default=variants, choices=variants)
    ap.add_argument("--out")
    return ap


def backend_of(args) -> str:
    return "nccl" if args.device == "cuda" else "gloo"


def finish_rank(rank: int, out: str, results) -> None:
    """The end of a spawned rank: rank 0 hands ``results`` to :func:`spawn_ranks`; the group ends."""
    import torch.distributed as dist

    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def gather_objects(obj, world: int) -> list:
    """Every rank's ``obj``, in rank order, on every rank (a collective)."""
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def write_collective_json(args, rows: list[dict]) -> None:
    """``--out``: the machine, the backend, the arguments and the rows."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_info(), "backend": backend_of(args), "args": vars(args), "rows": rows}, f,
                      indent=2)
        print(f"wrote {args.out}")


def spawn_ranks(worker, ranks: int, args):
    """Runs ``worker(rank, world, init_file, args, out_file)`` on ``ranks`` spawned processes
    (gloo/NCCL rendezvous through ``init_file``) and returns the JSON that rank 0 wrote to
    ``out_file``."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "raw.json")
        mp.start_processes(worker, args=(ranks, os.path.join(d, "init"), args, out), nprocs=ranks,
                           start_method="spawn")
        with open(out) as f:
            return json.load(f)


def write_json(path: str | None, obj) -> None:
    """``obj`` as indented JSON at ``path`` (its folder made), when a path is given (a benchmark's --out)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(obj, f, indent=2)


def host_step_args(ap, *, ctx: int, batch: int, bucket: float, rounds: int) -> None:
    """The arguments of the CPU-offload step benchmarks on a TinyGPT (offload_host_batch.py,
    offload_speculation.py): model size, device, group size, the host worker's threads, the rounds."""
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=ctx)
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--bucket", type=float, default=bucket, help="reduce_bucket_size: the groups' size")
    ap.add_argument("--threads", type=int, default=1, help="the host step's OpenMP threads (ZEROCORE_HOST_STEP_THREADS)")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--steps", type=int, default=5, help="steps per variant per round")


def interleaved(engines: dict, one, rounds: int, steps: int, warmup: int = 3) -> dict[str, list]:
    """``one(engine)`` ``warmup`` times per engine, then ``rounds`` rounds of ``steps`` calls per engine, the
    engines in a fresh order each round (random.Random(round)); each engine's results in call order."""
    for e in engines.values():
        for _ in range(warmup):
            one(e)
    out = {k: [] for k in engines}
    for r in range(rounds):
        order = list(engines)
        random.Random(r).shuffle(order)
        for k in order:
            for _ in range(steps):
                out[k].append(one(engines[k]))
    return out
