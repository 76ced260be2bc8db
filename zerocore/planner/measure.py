"""The measured side: the peak of the tensor bytes a real training step allocates under the
engine, from the CPU allocator's own events (the profiler's memory records, which also see
storages resized in place), on top of what the engine holds when the step starts; and the
growth of the process's peak RSS over the step."""
from __future__ import annotations

import os

from torch.profiler import ProfilerActivity, profile

from ..runtime.memory import held_bytes


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the current RSS
        return True
    except OSError:
        return False


def _engine_tensors(engine) -> list:
    out = []
    for g, shard in zip(engine.groups, engine.shards):
        out += [t for t in g.tensors().values() if t is not None]
        out += [t for t in shard.tensors().values() if t is not None]
    for g in engine.frozen_groups:  # stage 3's partitioned frozen parameters (gathered per unit)
        out += [t for t in g.tensors().values() if t is not None]
    return out + list(engine.reducer.bucket_tensors())


def dispatch_peak(engine, run_forward) -> int:
    """The same step's peak from a memory-tracking dispatch mode (torch's MemTracker) over real
    tensors: every storage an op on this thread creates, until it dies (on whatever thread), plus
    the engine's held tensors and their in-place resizes."""
    import warnings

    from .trace import FrozenSafeMemTracker

    mt = FrozenSafeMemTracker()
    mt.track_external(*_engine_tensors(engine))
    with mt, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
        loss = run_forward()
        engine.backward(loss)
        engine.step()
        del loss
    return int(sum(mt._peak_mem.values()))


def measure_step(engine, run_forward) -> dict:
    """One forward/backward/step of ``engine`` (``run_forward() -> loss``); returns the bytes held
    before it (``between``), the peak live tensor bytes during it (``peak``) and the peak RSS
    growth over it (``rss_growth``, None where /proc cannot reset the high-water mark)."""
    held = held_bytes(engine)
    base = held["total"] + held["host_total"]
    rss0 = _status_kb("VmRSS")
    rss_ok = _reset_peak_rss()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = run_forward()
        engine.backward(loss)
        engine.step()
        del loss
    rss_growth = _status_kb("VmHWM") - rss0 if rss_ok else None
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")]
    events.sort(key=lambda ev: ev[0])
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return {"between": base, "peak": base + peak, "rss_growth": rss_growth, "held": held,
            "pid": os.getpid()}
