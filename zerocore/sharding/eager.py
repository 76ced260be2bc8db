"""The engine's module hooks run eagerly under ``torch.compile``.

A compiled module (``module.compile()``, also after ``zerocore.initialize``) would otherwise have
Dynamo trace the hooks into its graph: the gathers, the storage resizes and the parameter swaps
would become graph operations replayed on tensors autograd saved, and the collectives would be
reordered. FSDP2 keeps its hooks out the same way. Dynamo breaks the graph at each hook and runs it,
and every frame it calls, as plain Python; unlike ``torch._dynamo.disable``'s wrapper (~3 us per
call measured here), marking the hook's code costs nothing per call when nothing is compiled.
"""
from __future__ import annotations

import torch


def eager_only(fn):
    """``fn`` (a hook) and what it calls are never traced by Dynamo; returns ``fn`` itself."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:  # a torch without per-code strategies: Dynamo's own (costlier) wrapper
        return torch._dynamo.disable(fn, reason="zerocore engine hook")
    set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    fn._torchdynamo_disable = True  # not inlined while tracing the module's call: a graph break
    fn._torchdynamo_disable_msg = "zerocore engine hook"
    return fn
