"""Stage 3's "this unit's backward is over" signal, once per unit instead of once per parameter.

The pre-forward hook passes the unit's tensor inputs through :class:`PostBackward`, an identity
autograd Function (FSDP2's ``RegisterPostBackwardFunction``). Its backward runs when the
gradients of those inputs are complete, i.e. after every node of the unit's forward; the
autograd engine runs ``AccumulateGrad`` nodes before any other ready node, so the unit's
parameter gradients are in ``.grad`` by then. Units whose inputs need no gradient (the first
block), the root, and units whose outputs went unused never get the signal: the reducer's
end-of-backward pass handles those.
"""
from __future__ import annotations

import torch


class PostBackward(torch.autograd.Function):
    """Identity on the inputs; ``done()`` is called once their gradients are complete."""

    @staticmethod
    def forward(ctx, done, *inputs):
        ctx.done = done
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None, *grads)


def through_post_backward(args: tuple, done) -> tuple | None:
    """``args`` with its gradient-requiring tensors routed through :class:`PostBackward` (None
    when none requires a gradient: the end-of-backward pass covers the unit)."""
    idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not idx:
        return None
    out = PostBackward.apply(done, *[args[i] for i in idx])
    new = list(args)
    for i, t in zip(idx, out):
        new[i] = t
    return tuple(new)
