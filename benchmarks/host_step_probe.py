"""T_host of an offloaded zerocore engine: its host Adam step alone, on copies of the same host
shards (fp32 master, m, v, the landed 16-bit gradient, the 16-bit output), with the same tiles and
the same thread count as the engine's host-step worker, on a thread of its own as the worker is.
The engine's state is not touched. Set beside T_device (the same stage without offload, in the same
run) it says what the offloaded step could take at best: max(T_device, T_host) when the host step
overlaps the device's work, T_device + T_host when it does not.

Used by step_cuda.py after an offload variant's timed steps; callable on a CPU engine too (the
tests run it there)."""
from __future__ import annotations

import statistics
import time

import torch

from zerocore import ops
from zerocore.offload.host_shard import HostOptimizerShard
from zerocore.runtime.off_stack import run_on_thread


def host_shards(engine) -> list[HostOptimizerShard]:
    offload = getattr(engine, "offload", None)
    if offload is None:
        return []
    return [s for s in offload.shards.values() if isinstance(s, HostOptimizerShard) and s.split > 0]


def host_step_seconds(engine, reps: int = 3) -> dict | None:
    """{'median_ms', 'min_ms', 'threads', 'elements', 'reps', 'shards_writing_16bit'} of the host Adam over ``engine``'s host
    shards, or None when it has none (no CPU optimizer offload)."""
    shards = host_shards(engine)
    if not shards:
        return None
    for s in shards:
        s.ready.wait()  # stage 3: the worker may still be stepping
    copies = []
    for s in shards:
        h = s.split
        # the 16-bit values the step writes: staged (out_h), or straight into host-resident parameters
        # (stage 3 with parameter offload: a write of the same size, timed here into a buffer of its own)
        out = torch.empty_like(s.out_h) if s.out_h is not None else (
            torch.empty(h, dtype=s.group.layout.dtype) if s.half else None)
        copies.append((s.master_h.clone(), s.grad_h, s.exp_avg_h.clone(), s.exp_avg_sq_h.clone(), out, s.tile, h))
    stepper = engine.offload.stepper  # None: stages 1/2 step inline, with the training thread's count
    threads = stepper.threads if stepper is not None else torch.get_num_threads()

    def run() -> list[float]:
        torch.set_num_threads(threads)  # per calling thread, as the worker sets it once (offload/stepper.py)
        times = []
        for r in range(reps):
            t0 = time.perf_counter()
            for master, grad, m, v, out, tile, h in copies:
                for a in range(0, h, tile):
                    b = min(h, a + tile)
                    ops.adam_step(master[a:b], grad[a:b], m[a:b], v[a:b], lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.01, step=r + 2, adamw_mode=True, grad_scale=1.0,
                                  param_out=None if out is None else out[a:b])
            times.append(time.perf_counter() - t0)
        return times

    times = run_on_thread(run, "host-step-probe")
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3, "threads": threads,
            "elements": sum(c[-1] for c in copies), "reps": reps,
            "shards_writing_16bit": sum(c[4] is not None for c in copies)}
