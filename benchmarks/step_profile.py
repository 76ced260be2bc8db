"""One variant's steps under ``torch.profiler``: where a step's time goes on the host and the device.

``profile_steps(step, batches, n, out_dir, name)`` runs ``n`` steps (after the timed ones, so the
caches, allocator and compiled graphs are warm) and writes to ``out_dir``:

- ``profile_<name>.txt``: the operators by self device time and by self host time (top 40 each);
- ``trace_<name>.json.gz``: the Chrome trace (chrome://tracing, ui.perfetto.dev).

It returns, per step: wall ms, device busy ms (the union of kernel/memcpy/memset intervals on any
stream), kernel launches, host<->device memcpys by direction, and the host-blocking calls the CUDA
runtime saw (stream/device/event synchronisations, synchronous memcpys), and each memcpy direction's
summed device time (``memcpy_ms``). ``device_idle_share`` =
1 - busy / wall: the share of the step the GPU waited for the host (a short step that is host-bound
shows it here, not in its kernels)."""
from __future__ import annotations

import gzip
import os
import shutil
import time

import torch

# CUDA runtime calls that block the host until the device catches up (what host_waits counts too)
BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LAUNCH = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length (ms) of the union of [start, end) microsecond intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def _is_device(evt) -> bool:
    kind = getattr(evt, "device_type", None)
    return kind is not None and "CUDA" in str(kind)


def summarize(events, n: int, wall_s: float) -> dict:
    """Per-step figures from a profile's FunctionEvents (``prof.events()``) of ``n`` steps."""
    busy, launches, blocking, memcpy, memcpy_us = [], 0, {}, {}, {}
    for e in events:
        name = e.name
        if _is_device(e):
            busy.append((e.time_range.start, e.time_range.end))
            if name.startswith("Memcpy"):
                memcpy[name] = memcpy.get(name, 0) + 1
                memcpy_us[name] = memcpy_us.get(name, 0.0) + (e.time_range.end - e.time_range.start)
        elif name in LAUNCH:
            launches += 1
        elif name in BLOCKING or (name.startswith("cudaMemcpy") and "Async" not in name):
            blocking[name] = blocking.get(name, 0) + 1
    wall_ms = wall_s * 1e3 / n
    busy_ms = _union_ms(busy) / n
    return {"steps": n, "wall_ms": wall_ms, "device_busy_ms": busy_ms,
            "device_idle_share": max(0.0, 1 - busy_ms / wall_ms) if wall_ms else None,
            "launches": launches / n, "blocking_calls": {k: v / n for k, v in sorted(blocking.items())},
            "memcpy": {k: v / n for k, v in sorted(memcpy.items())},
            # each direction's copies' summed device time: over the bytes a step moves, the rate they ran at
            "memcpy_ms": {k: v / 1e3 / n for k, v in sorted(memcpy_us.items())}}


def _table(prof, key: str, limit: int = 40) -> str:
    try:
        return prof.key_averages().table(sort_by=key, row_limit=limit)
    except (KeyError, AttributeError, RuntimeError) as e:  # a torch without that column
        return f"(no table sorted by {key}: {e})"


def profile_steps(step, batches, n: int, out_dir: str, name: str, sync=None) -> dict:
    """Profiles ``n`` calls of ``step(inputs, targets)``; ``sync``: the device synchronisation that
    closes the measured region (torch.cuda.synchronize on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() and sync is not None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    os.makedirs(out_dir, exist_ok=True)
    if sync:
        sync()
    with profile(activities=activities, record_shapes=False) as prof:
        t0 = time.perf_counter()
        for i in range(n):
            b = batches[i % len(batches)]
            step(b[:, :-1], b[:, 1:])
        if sync:
            sync()
        wall = time.perf_counter() - t0
    out = summarize(prof.events(), n, wall)
    with open(os.path.join(out_dir, f"profile_{name}.txt"), "w") as f:
        f.write(f"{name}: {n} steps, per step {out}\n\n")
        if cuda:
            f.write("by self device time\n" + _table(prof, "self_cuda_time_total") + "\n\n")
        f.write("by self host time\n" + _table(prof, "self_cpu_time_total") + "\n")
    trace = os.path.join(out_dir, f"trace_{name}.json")
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)
    return out
