"""``loss.backward()`` through an engine, as DeepSpeed >= 0.18.3 allows: the engine's backward
bracket (begin: the checks, the gatherer and the reducer told a backward starts; finish: the
reductions completed) driven by autograd instead of by ``engine.backward(loss)``.

How the bracket is found without ``engine.backward``:
- **Begin.** Every forward through the engine puts a pre-hook on the autograd node of each of its
  outputs (``hook_outputs``). The first of them to fire in a backward (autograd's graph task) opens
  it. A gradient that reaches the engine without passing an output (the loss was
  computed from ``engine.module(x)``, not ``engine(x)``) opens it from the reducer's or the
  gatherer's own hooks ("late"), after some gradients have already landed.
- **Finish.** Opening queues the finish on autograd's engine (``queue_callback``, as FSDP2 ends its
  backward): it runs when the graph task's last node has run, before ``backward()`` returns, on
  whichever thread ran that node.
- **Scale.** The loss is not touched, so the 1/gradient_accumulation_steps that ``engine.backward``
  puts on the loss is applied where the reduced gradients are added in (``GradReducer``'s
  ``grad_factor``): exactly once per gradient, however the outputs depend on each other (a hook that
  divided each output's gradient, as DeepSpeed's does, divides twice where the loss is itself an
  output computed from another, e.g. a Transformers model's ``loss`` and ``logits``). fp16's loss scale
  is the caller's: ``engine.scale(loss).backward()``; a backward through an output without it raises
  (DeepSpeed's rule), since unscaled fp16 gradients underflow silently. One that reached the engine
  late (``engine.module(x)``: DeepSpeed reduces it unscaled and its step still divides by the scale)
  has the scale applied with the 1/accumulation steps, and a warning.
- **Failure.** A backward that raises never runs its queued finish. The next call into the engine
  from outside autograd (forward, backward, step, zero_grad) finds the bracket still open and
  aborts it as ``engine.backward`` aborts its own (the gradients as they were before it).

While ``engine.backward`` runs, its own hooks do nothing; another engine whose outputs its loss also
reached opens its own backward, with the first engine's loss factor taken back out (``_LOSS_FACTORS``).

Under a ``torch.func`` transform (``grad``, ``grad_and_value``, ``jacrev``, ``vjp``, ``vmap`` of them) the
engine is a plain function: its forward hooks no outputs and a backward inside the transform opens no bracket
(the transform's gradients are the caller's values, not training gradients: nothing is reduced, scaled or
stepped), as DeepSpeed's engine does since 0.19.
"""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Mapping

import torch

from .._transforms import functorch_transforming
from .._weak import GONE, EngineGone
from ..sharding.reducer import OUTSIDE_BACKWARD
from . import offload_states
from .backward_bracket import AUTOGRAD, ENGINE


# What the engine.backward under way multiplied its loss by (its loss scale / accumulation steps): another
# engine whose outputs that loss also reached takes it back out of its own gradients (one entry per nested call).
# Process-wide, not thread-local: on a GPU the hooks that read it run on autograd's device threads.
_LOSS_FACTORS: list[float] = []


class scaled_loss_backward:
    """``with scaled_loss_backward(factor): (loss * factor).backward()``: engine.backward's autograd call."""

    def __init__(self, factor: float):
        self.factor = factor

    def __enter__(self):
        _LOSS_FACTORS.append(self.factor)

    def __exit__(self, *exc):
        _LOSS_FACTORS.pop()

NEEDS_SCALE = ("zerocore: fp16 training needs the loss scaled before backward, but loss.backward() was called on "
               "an unscaled loss: call engine.scale(loss).backward() (or engine.backward(loss)); unscaled fp16 "
               "gradients underflow to zero (DeepSpeed: Loss scaling is required for this configuration)")
UNSCALED_LATE = ("zerocore: loss.backward() under fp16 on a loss computed from engine.module(x), without "
                 "engine.scale(loss): its gradients are multiplied by the loss scale as they are reduced, after fp16 "
                 "may have rounded the smallest to zero; call engine.scale(loss).backward() or engine.backward(loss) "
                 "(this warning is given once per engine)")
class NotALoss(ValueError, AssertionError):
    """engine.scale() given something other than a scalar loss: a ValueError, and the AssertionError
    DeepSpeed's ``scale`` raises (scripts written for it catch that)."""


def graph_task() -> int:
    """The autograd graph task running on this thread (-1: none, i.e. not inside a backward)."""
    return torch._C._current_graph_task_id()


def output_hook(engine) -> Callable[[], None]:
    """What runs when autograd reaches an output of the engine's forwards: one closure per engine,
    holding it weakly (a hook lives in C++ in a graph the user may keep; a strong reference would keep
    the engine's memory alive through a cycle the collector cannot see). It takes no gradient and
    changes none: the scale is applied at the reduction."""
    me = weakref.ref(engine)

    def on_output_reached() -> None:
        eng = me()
        if eng is not None and eng._bracket is not ENGINE and not functorch_transforming():
            open_from_autograd(eng, late=False)
    return on_output_reached


def hook_outputs(outputs, hook, call_before) -> None:
    """``hook()`` before the autograd node that made each tensor of ``outputs`` (a tensor, or tuples, lists
    and mappings of them, as a Transformers ``ModelOutput`` is) runs: a node pre-hook set by ``call_before``
    (``ops.params.param_ops().call_before_node``: one native call, about 4x cheaper than ``Tensor.register_hook``)."""
    if isinstance(outputs, torch.Tensor):
        if outputs.grad_fn is not None:
            call_before(outputs, hook)
    elif isinstance(outputs, (tuple, list)):
        for item in outputs:
            hook_outputs(item, hook, call_before)
    elif isinstance(outputs, Mapping):
        for item in outputs.values():
            hook_outputs(item, hook, call_before)


def open_from_autograd(eng, *, late: bool) -> None:
    """A gradient reached the engine inside a backward that ``engine.backward`` did not start: opens
    the bracket for this graph task (once) and queues its finish. ``late``: reached through the
    reducer's or gatherer's hooks, not an output (some gradients have landed already)."""
    task = graph_task()
    if task == -1:  # not inside autograd's engine: nothing could finish it
        raise RuntimeError(OUTSIDE_BACKWARD)
    if eng._bracket is AUTOGRAD:
        if eng._bracket_task == task:
            if eng._bracket_unscaled and not late:  # opened by a stage-3 unit's hook on this same output
                raise RuntimeError(NEEDS_SCALE)
            return
        eng._abort_backward()  # an earlier loss.backward() raised before its finish ran
    elif eng._bracket is ENGINE:  # engine.backward's own backward: its hooks reached us while it runs
        return
    # (another engine's engine.backward(loss) reached this one's outputs: its loss factor is not this one's)
    factor, unscaled = 1.0 / eng.gas / (_LOSS_FACTORS[-1] if _LOSS_FACTORS else 1.0), False
    if eng._scale_pending:
        eng._scale_pending = False
    elif eng.scaler.needed:
        if not late:
            raise RuntimeError(NEEDS_SCALE)
        # engine.module(x) under fp16 without engine.scale(): DeepSpeed reduces such gradients unscaled and its
        # step divides them by the loss scale anyway (updates loss_scale times too small). Here they are scaled
        # as they are added in, so the update is right up to the small gradients fp16 rounded to zero.
        factor, unscaled = factor * eng.scaler.scale, True  # (warned at the finish: an output may still say)
    eng._begin_backward(AUTOGRAD, grad_factor=factor, late=late)
    eng._bracket_task, eng._bracket_unscaled = task, unscaled
    me = weakref.ref(eng)
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _finish_queued(me, task))


def _finish_queued(me, task: int) -> None:
    eng = me()
    if eng is None:
        raise EngineGone(GONE)
    if eng._bracket is AUTOGRAD and eng._bracket_task == task:
        if eng._bracket_unscaled and not eng._warned_unscaled:
            eng._warned_unscaled = True
            warnings.warn(UNSCALED_LATE, RuntimeWarning, stacklevel=2)
        eng._finish_backward()


def close_stale(eng) -> None:
    """Called where the engine is entered from the user's code: a loss.backward() bracket still open
    there belongs to a backward that raised (inside autograd, e.g. a checkpointed forward re-run
    during backward, it is the live one)."""
    if eng._bracket is AUTOGRAD and graph_task() == -1:
        eng._abort_backward()


def scale(eng, loss: torch.Tensor) -> torch.Tensor:
    """``engine.scale(loss)``: the loss times fp16's loss scale (the loss itself under bf16/fp32), to
    call ``.backward()`` on; marks the next backward as scaled. Not divided by the accumulation
    steps: that is applied to the gradients (module docstring), as ``engine.backward`` applies it."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
        what = type(loss).__name__ if not isinstance(loss, torch.Tensor) else (
            f"a tensor of shape {tuple(loss.shape)}" if loss.numel() != 1 else "a tensor without grad_fn")
        raise NotALoss(f"zerocore: engine.scale(loss) takes the loss as a scalar tensor with grad_fn (this "
                       f"micro-batch's, computed from the model's outputs); got {what}. For a non-scalar output call "
                       "output.backward(gradient) directly (bf16/fp32)")
    eng._scale_pending = True
    return loss.float() * eng.scaler.scale if eng.scaler.needed else loss


class AutogradBackward:
    """The engine's methods for a backward autograd runs without ``engine.backward`` (mixed into
    :class:`zerocore.Engine`; the bracket itself, shared with ``engine.backward``: backward_bracket.py)."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's ``engine.scale(loss)``, for ``engine.scale(loss).backward()`` in place of
        ``engine.backward(loss)``: the loss times fp16's loss scale (unchanged under bf16/fp32, where a
        plain ``loss.backward()`` works as well). Either way the engine divides the gradients by
        ``gradient_accumulation_steps`` and reduces them when autograd is done."""
        self._alive()
        return scale(self, loss)

    def _opened_late(self) -> None:
        """The reducer's or gatherer's hooks saw a gradient with no backward open."""
        if functorch_transforming():
            return
        offload_states.check_resident(self, "backward")
        open_from_autograd(self, late=True)

    def _backward_epilogue(self) -> None:
        """DeepSpeed's name for the end of a backward, which scripts written for DeepSpeed < 0.18.3
        call after their own ``loss.backward()``: here autograd's queued callback has ended it
        already, so this finishes only a backward still open (none, normally)."""
        if self._bracket is AUTOGRAD:
            self._finish_backward()
