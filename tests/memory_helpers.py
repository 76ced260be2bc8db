"""What the memory tests read: the process's RSS, and weak references to every tensor of an engine's
state (what must be freed with it). Shared by tests/runtime/test_engine_lifetime.py and the scripts run
in fresh processes (tests/runtime/rss_after_destroy.py, tests/integrations/memory_run.py)."""
from __future__ import annotations

import weakref

import torch


def rss() -> int:
    """This process's resident set size, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def state_tensor_refs(engine) -> list[weakref.ref]:
    """Weak references to every tensor of the engine's state: flat parameters, gradients, master,
    moments, host state, reduction buckets."""
    tensors = []
    for g in engine.groups:
        tensors += [t for t in g.tensors().values() if isinstance(t, torch.Tensor)]
    for s in engine.shards:
        tensors += [t for t in s.tensors().values() if isinstance(t, torch.Tensor)]
    tensors += engine.reducer.bucket_tensors()
    assert tensors
    return [weakref.ref(t) for t in tensors]
