"""Whether a ``torch.func`` transform (``grad``, ``grad_and_value``, ``jacrev``, ``vjp``, ``vmap``) is running:
inside one, an engine is the caller's plain function (nothing reduced or stepped: runtime/torch_backward.py),
and a stage-3 forward, which gathers parameters in place, is refused under a differentiating one
(sharding/gatherer.py)."""
from __future__ import annotations

import torch

# (private to torch: a torch without it runs no transform this needs to see). Hot paths call it inline
# (``peek_interpreter_stack is not None and peek_interpreter_stack() is not None``: one C call, no Python frame).
peek_interpreter_stack = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)


def functorch_transforming() -> bool:
    """True inside a ``torch.func`` transform (its interpreter stack is not empty)."""
    return peek_interpreter_stack is not None and peek_interpreter_stack() is not None


def differentiating_transform() -> bool:
    """True inside a ``torch.func`` transform that differentiates (``grad``, ``vjp``, ``jacrev``, ``jvp``, ...,
    alone or under ``vmap``): one that refuses an in-place write to a captured tensor. ``vmap`` alone does not."""
    if not functorch_transforming():
        return False
    from torch._C._functorch import TransformType, get_interpreter_stack

    return any(i.key() in (TransformType.Grad, TransformType.Jvp) for i in get_interpreter_stack())


STAGE3_UNDER_TRANSFORM = (
    "zerocore: a differentiating torch.func transform (grad, grad_and_value, jacrev, vjp, jvp) reached a stage-3 "
    "engine's forward: stage 3 gathers each parameter into its storage in place as the forward reaches it, which a "
    "transform refuses on a captured tensor. Stages 0-2 run transforms through the engine; at stage 3 compute the "
    "transform with a whole copy of the model (engine.full_state_dict() loaded into a plain module). Nothing was "
    "gathered: training continues.")
