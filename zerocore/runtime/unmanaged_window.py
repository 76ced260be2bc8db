"""``managed_gradient_accumulation: false`` (DeepSpeed 0.19's): the caller's ``step()`` ends each accumulation
window, however many ``backward()`` calls came before it.

The engine's boundary is then "inside step()" (``DeepSpeedMethods.is_gradient_accumulation_boundary``), so every
backward is a window's inner micro-batch: stages 0/1 accumulate each rank's gradients in the full buffer without
reducing (as inside ``no_sync``), stages 2/3 reduce every backward into their shards as always. ``step()`` first
finishes the window here, then updates as at any boundary:
- stages 0/1: the accumulated buffer is reduced now (the reducer's boundary pass, with no autograd in it), which
  also lands each group's gradient on the host under optimizer offload;
- stages 2/3: the shards are final already; under optimizer offload each group's gradient lands now (its host
  copy and norm part), since none of the backwards was the boundary's.
"""
from __future__ import annotations


def step(engine, lr_kwargs) -> None:
    """``engine.step`` of such an engine (set at initialize; managed engines call ``Engine.step`` itself, with no
    call more): the boundary is on while it runs."""
    engine._in_step = True
    try:
        type(engine).step(engine, lr_kwargs)
    finally:
        engine._in_step = False


def finish_window(engine) -> None:
    """Before the update of an unmanaged window's ``step()`` (``engine._in_step`` is set: the boundary)."""
    reducer = engine.reducer
    if reducer.full_grads:
        reducer.reduce_held(True)
    elif engine.offload is not None:
        for g in engine.groups:
            if g.has_grad:
                engine.offload.land(g.index)
