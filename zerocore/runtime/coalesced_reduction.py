"""``engine.coalesce_grad_reduction()`` (DeepSpeed 0.19's context manager): the backwards inside the block reduce
nothing; each rank's gradients accumulate locally (stages 0/1 in the full gradient buffer, as inside ``no_sync()``;
stages 2/3 in full-size ``.grad``, summed by autograd: the whole model's gradients on every rank while the block
runs), and leaving the block reduces their sum once: the boundary's reduction pass, with no autograd in it (under
optimizer offload each group's gradient lands then). One block is one optimizer step's micro-batches; ``step()``
inside it is refused, as in DeepSpeed: call it after the block.

Refused as DeepSpeed refuses: with ``managed_gradient_accumulation: false`` (the caller's ``step()`` owns the
boundary: DeepSpeed's AssertionError), at stage 0 (NotImplementedError), nested in or around ``no_sync()``. A
block left by an exception reduces nothing: its gradients are not reduced, so the window is refused at ``step()``
until ``zero_grad()`` (named, not silent). Inside the block ``safe_get_full_grad(p)`` is this rank's own
unreduced sum so far, ``p.grad`` (DeepSpeed's documented behaviour). Beyond DeepSpeed: ``loss.backward()`` (not
``engine.backward``) inside it at stages 2/3 with ``gradient_accumulation_steps`` > 1 is refused (its 1/gas factor
is applied as gradients are reduced, and the block sums them in ``.grad`` first)."""
from __future__ import annotations

import contextlib

from .backward_bracket import CLOSED
from .misuse import NoSyncMisuse


@contextlib.contextmanager
def coalesced(engine):
    if not engine.config.managed_gradient_accumulation:
        raise NoSyncMisuse("zerocore: coalesce_grad_reduction is not supported with managed_gradient_accumulation="
                           "False; the caller already owns the accumulation boundary via step()")
    stage = engine.zero_optimization_stage()
    if engine.pipeline_parallelism:
        raise NotImplementedError("zerocore: coalesce_grad_reduction is not supported under pipeline parallelism")
    if stage == 0:
        raise NotImplementedError(f"zerocore: coalesce_grad_reduction requires ZeRO stage 1/2/3, got stage {stage} "
                                  "(stage 0 keeps no sharded gradients to coalesce into; use no_sync())")
    if engine._in_no_sync or engine._coalescing:
        raise NoSyncMisuse("zerocore: coalesce_grad_reduction cannot be nested inside another no_sync context "
                           "(no_sync() or coalesce_grad_reduction())")
    if engine._bracket is not CLOSED:
        raise RuntimeError("zerocore: coalesce_grad_reduction() entered during a backward")
    reducer = engine.reducer
    engine._coalescing = True
    reducer.deferred = True
    reducer.deferred_backwards = 0
    ok = False
    try:
        yield
        ok = True
    finally:
        engine._coalescing = False
        reducer.deferred = False
        ran, reducer.deferred_backwards = reducer.deferred_backwards, 0
        if ran and not ok:
            reducer.window_lost = reducer.window_lost or (
                "the coalesce_grad_reduction() block was left by an exception after its backwards: their gradients "
                "were never reduced")
    if ran:  # the block's one reduction (stages 0/1 at the boundary, else kept for it), then step() may follow
        engine.reducer.reduce_held(engine.is_gradient_accumulation_boundary())
        engine._backward_done = True


def refuse_step(engine) -> None:
    """``step()`` inside the block (called by Engine.step before its no_sync refusal)."""
    if engine._coalescing:
        raise NoSyncMisuse("zerocore: step() inside coalesce_grad_reduction(); the block's gradients are reduced "
                           "when it ends: call step() after the block (DeepSpeed: It is illegal to call "
                           "Engine.step() inside no_sync context manager)")
