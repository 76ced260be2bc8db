"""The GPU runner of benchmarks/step.py: one variant at a time (large models do not fit twice),
each built, warmed up, timed, torn down, and checked to have given its memory back before the next.

Memory is read from the caching allocator (``memory_allocated``: bytes in live tensors) and
reported net of the variant's *baseline*, what was allocated just before it was built (the
batches, and whatever an earlier variant still held after a collection; kept absolute in the JSON
as ``baseline_GiB``): ``peak_GiB`` over the timed steps, ``between_steps_GiB`` after the last one, and
``pinned_GiB``: page-locked host memory the variant holds (CPU offload's buffers), ``host_GiB``: the
process's resident host memory (RSS) beyond its baseline, both between steps.
Then the variant is torn down the way a user would: ``step.close()`` (its library's teardown:
zerocore's or DeepSpeed's ``engine.destroy()``; torch's objects have none) and ``del``, and the
allocator is read without ``gc.collect()`` (``left_after_del_GiB``: what a user's process keeps
when a reference cycle holds the variant until Python's collector happens to run), then after
``gc.collect()`` and ``empty_cache()`` (``left_after_gc_GiB``: a leak). More than 1 MiB left
either way: a warning on stderr. The next variant starts after that collection. Before the first
baseline the libraries' own per-process memory is made (``CudaMemory.prime``: cuBLAS's workspaces),
so that no variant is charged with it.

``run_interleaved`` (step.py ``--interleave``): every variant built first, then rounds in a fresh
order each, as the CPU runner does: for short, host-bound steps whose time drifts with the host
(a Hugging Face Llama's 50 ms step varied 47-138 ms on an H100's VM run one variant at a time).
Memory figures are then per run, not per variant.

A variant that fails to build, in its warm-up or in a timed step (out of memory, say) is
skipped with its error (type and message) and the run goes on. The ranks exchange their errors
after each of the three phases, so that all of them skip it together. (A rank that fails while
its peers wait in one of the step's collectives cannot be rescued that way: they wait for it,
as in any NCCL job.) Whatever the variant allocated is freed as above before the next one.
"""
from __future__ import annotations

import gc
import os
import sys
import time

import torch
import torch.distributed as dist

import host_step_probe
import step_profile

from _common import gather_objects

GIB = float(1 << 30)
LEAK_BYTES = 1 << 20  # more than this left after the teardown: a warning


class CudaMemory:
    """The caching allocator's counters and a synchronization, for one GPU (the tests pass a
    stand-in with the same methods)."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def pinned(self) -> int | None:
        """Bytes of page-locked host memory handed out: by torch's host allocator (``pin_memory``: DeepSpeed's
        offload buffers, in its power-of-two blocks) and by zerocore's (its offloaded state, sized to the page:
        zerocore/offload/host_memory.py); None where this torch does not count its own."""
        try:
            n = int(torch.cuda.host_memory_stats()["active_bytes.current"])
        except (AttributeError, KeyError, RuntimeError):
            return None
        from zerocore.offload import host_memory

        pool = host_memory._exact_pool
        return n + (pool.stats()["in_use_bytes"] if pool else 0)

    @staticmethod
    def host_rss() -> int | None:
        """This process's resident host memory (bytes): what the machine runs out of, pinned or not."""
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return None

    def prime(self) -> None:
        """Runs a matrix product forward and backward, fp32 and bf16, with and without a bias, so that
        torch's per-process library state exists before the first baseline: cuBLAS and cuBLASLt keep a
        workspace per handle (the training thread's and autograd's) and stream for the process's life
        (64 MiB on an H100), which the first variant of a run was charged with as a leak."""
        for dtype in (torch.float32, torch.bfloat16):
            w = torch.randn(64, 64, device=self.device, dtype=dtype, requires_grad=True)
            x = torch.randn(8, 64, device=self.device, dtype=dtype, requires_grad=True)
            (torch.nn.functional.linear(x, w, w[0]).sum() + (x @ w).sum()).backward()
        self.sync()


def run_variants(variants, build, batches, args, mem, rank: int, world: int) -> dict:
    """Runs each of ``variants`` alone (``build(name)`` returns its step) for ``args.warmup``
    steps, then ``args.steps * args.rounds`` timed ones. Returns ``times`` ({variant: [[seconds]
    per round]}), ``losses``, ``memory`` (every variant's, a skipped one's leftovers too) and
    ``not_built`` ({variant: why}, the same on every rank)."""
    out = {"times": {}, "losses": {}, "memory": {}, "not_built": {}}
    mem.prime()
    for v in variants:
        why, flat, losses, memory = _run_one(v, build, batches, args, mem, world)
        out["memory"][v] = memory
        for line in leak_warnings(v, memory):
            print(f"step.py rank {rank}: {line}", file=sys.stderr, flush=True)
        if why is not None:
            out["not_built"][v] = why
            print(f"step.py rank {rank}: skipped {v}: {why}", file=sys.stderr, flush=True)
        else:
            out["times"][v] = [flat[r * args.steps:(r + 1) * args.steps] for r in range(args.rounds)]
            out["losses"][v] = losses
        dist.barrier()
    return out


def _run_one(v, build, batches, args, mem, world):
    """(why skipped or None, step times, losses, memory) of one variant, torn down and collected."""
    _collect(mem)
    base, base_pinned, base_rss = mem.allocated(), mem.pinned(), mem.host_rss()
    memory = {"baseline_GiB": base / GIB}
    step, flat, losses, why = None, [], [], None
    try:
        step = build(v)
    except Exception as e:  # noqa: BLE001 - a configuration a library refuses, or out of memory: say why, go on
        why = _reason("failed to build", e)
    why = _agree(why, world)
    if why is None:
        try:
            _warm_up(step, batches, args.warmup, mem)
        except Exception as e:  # noqa: BLE001
            why = _reason("failed in warm-up", e)
        why = _agree(why, world)
    if why is None:
        try:
            flat, losses, peak, held = _timed(step, batches, args.steps * args.rounds, mem)
            memory.update(peak_GiB=(peak - base) / GIB, between_steps_GiB=(held - base) / GIB)
            pinned, rss = mem.pinned(), mem.host_rss()
            if pinned is not None and base_pinned is not None:  # the offloaded state's page-locked buffers
                memory["pinned_GiB"] = (pinned - base_pinned) / GIB
            if rss is not None and base_rss is not None:  # all the host memory it holds (the offloaded state)
                memory["host_GiB"] = (rss - base_rss) / GIB
        except Exception as e:  # noqa: BLE001
            why = _reason("failed in a timed step", e)
        why = _agree(why, world)
    if why is None:
        _after_timing(v, step, batches, args, mem, memory)
    if step is not None:
        closed = _close(step, failed=why is not None)
        if closed is not None:
            memory["close_error"] = closed
    del step  # the runner's last reference: from here on only the library can hold the memory
    memory["left_after_del_GiB"] = (mem.allocated() - base) / GIB
    _collect(mem)
    memory["left_after_gc_GiB"] = (mem.allocated() - base) / GIB
    return why, flat, losses, memory


def run_interleaved(variants, build, batches, args, mem, rank: int, world: int) -> dict:
    """As ``run_variants``, with every variant alive at once and ``args.rounds`` rounds of
    ``args.steps`` steps each, variants in a fresh order per round (the same on every rank).
    ``memory`` holds the run's (``run``: baseline, peak, left after the teardown) and each variant's
    T_host / profile; a variant that fails is skipped, the others go on."""
    import random

    out = {"times": {}, "losses": {}, "memory": {}, "not_built": {}}
    mem.prime()
    _collect(mem)
    base = mem.allocated()
    steps = {}
    for v in variants:
        why, step = None, None
        try:
            step = build(v)
            _warm_up(step, batches, args.warmup, mem)
        except Exception as e:  # noqa: BLE001 - a configuration a library refuses, or out of memory: say why, go on
            why = _reason("failed to build or warm up", e)
        why = _agree(why, world)
        if why is None:
            steps[v] = step
        else:
            out["not_built"][v] = why
            if step is not None:
                _close(step, failed=True)
        del step
    mem.reset_peak()
    for v in steps:
        out["times"][v], out["losses"][v] = [], []
    for r in range(args.rounds):
        order = list(steps)
        random.Random(r).shuffle(order)
        for v in order:
            dist.barrier()
            times, losses, _, _ = _timed(steps[v], batches, args.steps, mem)
            out["times"][v].append(times)
            out["losses"][v] += losses
    peak = mem.peak()
    for v, step in steps.items():
        _after_timing(v, step, batches, args, mem, out["memory"].setdefault(v, {}))
    for v in list(steps):  # in the same order on every rank: a teardown may be collective
        _close(steps.pop(v), failed=False)
    left_del = mem.allocated()
    _collect(mem)
    out["memory"]["run"] = {"baseline_GiB": base / GIB, "peak_GiB": (peak - base) / GIB,
                            "left_after_del_GiB": (left_del - base) / GIB,
                            "left_after_gc_GiB": (mem.allocated() - base) / GIB}
    return out


def _after_timing(v: str, step, batches, args, mem, memory: dict) -> None:
    """What a variant's timed steps are followed by, into ``memory``: a zerocore offload variant's T_host
    (its host Adam alone, host_step_probe.py) and, with ``--profile``, a few profiled steps. A probe's or
    the profiler's failure loses the figure, not the variant."""
    engine = getattr(step, "engine", None)
    if engine is not None and hasattr(engine, "offload"):
        try:
            t_host = host_step_probe.host_step_seconds(engine)
        except Exception as e:  # noqa: BLE001
            t_host = {"error": _reason("host step probe failed", e)}
        if t_host is not None:
            memory["host_step"] = t_host
    if getattr(args, "profile", None):
        rank = dist.get_rank()
        try:
            memory["profile"] = step_profile.profile_steps(
                step, batches, args.profile_steps, args.profile, v if rank == 0 else f"{v}_rank{rank}", sync=mem.sync)
        except Exception as e:  # noqa: BLE001
            memory["profile"] = {"error": _reason("profile failed", e)}


def _warm_up(step, batches, n: int, mem) -> None:
    for i in range(n):
        b = batches[i % len(batches)]
        step(b[:, :-1], b[:, 1:])
    mem.sync()  # an asynchronous error of the warm-up shows here, not in the first timed step


def _timed(step, batches, n: int, mem):
    """``n`` steps, each between two synchronizations: their seconds and losses, the peak
    allocation over them and the allocation after the last one (absolute bytes)."""
    mem.sync()
    mem.reset_peak()
    times, losses = [], []
    for i in range(n):
        b = batches[i % len(batches)]
        mem.sync()
        t0 = time.perf_counter()
        loss = step(b[:, :-1], b[:, 1:])
        mem.sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        del loss
    return times, losses, mem.peak(), mem.allocated()


def _close(step, failed: bool) -> str | None:
    """The step's teardown; its error as text (the run goes on: the leftovers will show it)."""
    try:
        step.close(failed=failed)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def _collect(mem) -> None:
    gc.collect()
    mem.sync()
    mem.empty_cache()


def _reason(phase: str, e: BaseException) -> str:
    return f"{phase}: {type(e).__name__}: {e}"


def _agree(why: str | None, world: int) -> str | None:
    """Every rank learns every rank's error of the phase: the first rank's with one is the
    reason for all (a variant skipped on one rank alone would leave the others in its collectives)."""
    for r, w in enumerate(gather_objects(why, world)):
        if w is not None:
            return w if world == 1 else f"rank {r}: {w}"
    return None


def leak_warnings(v: str, memory: dict) -> list[str]:
    """The warnings a variant's teardown deserves: memory not back at the baseline (more than
    ``LEAK_BYTES``) after ``close()`` and ``del``, or even after ``gc.collect()``; a failed ``close()``."""
    lines = []
    if memory.get("close_error"):
        lines.append(f"WARNING: {v}: close() raised {memory['close_error']}")
    if "left_after_gc_GiB" not in memory:  # a CPU run: no allocator figures
        return lines
    left_del, left_gc = memory["left_after_del_GiB"], memory["left_after_gc_GiB"]
    if left_gc * GIB > LEAK_BYTES:
        lines.append(f"WARNING: {v} LEAKED {left_gc:.3f} GiB: still allocated after close(), del and gc.collect() "
                     f"({left_del:.3f} GiB before the collection); the next variants' baselines include it")
    elif left_del * GIB > LEAK_BYTES:
        lines.append(f"WARNING: {v} held {left_del:.3f} GiB after close() and del until gc.collect() freed it: a "
                     f"reference cycle keeps the variant alive, so a user's process holds that memory until Python's "
                     f"collector happens to run")
    return lines
