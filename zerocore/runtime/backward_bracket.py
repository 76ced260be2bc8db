"""The engine's backward bracket, shared by ``engine.backward(loss)`` and a ``loss.backward()`` that autograd's
hooks found (``torch_backward.py``): begin (the checks, the gatherer and the reducer told a backward starts),
finish (the reductions completed) and abort (a backward that raised: the gradients as they were before it).
Mixed into :class:`zerocore.Engine`.
"""
from __future__ import annotations

# which backward is open (BackwardBracket._bracket)
CLOSED, ENGINE, AUTOGRAD = "closed", "engine.backward", "loss.backward"


class BackwardBracket:
    # Class-level defaults, written on the engine as they change. Which backward is open, and for a
    # loss.backward() its autograd graph task and whether it is fp16's without engine.scale() (torch_backward.py)
    _bracket = CLOSED
    _bracket_task = -1
    _bracket_unscaled = False
    _scale_pending = False  # engine.scale(loss) was called for the next loss.backward()
    _warned_unscaled = False  # (torch_backward.UNSCALED_LATE, once per engine)

    def _begin_backward(self, bracket: str, grad_factor: float = 1.0, late: bool = False) -> None:
        """Opens a backward: engine.backward's, or a loss.backward()'s that autograd's hooks found
        (``grad_factor`` and ``late``: GradReducer.begin_backward)."""
        # (a caller that owns the boundary, unmanaged or through set_gradient_accumulation_boundary, may run several
        # backwards before one step(), as DeepSpeed allows)
        local = self._in_no_sync or self._coalescing  # each rank keeps its gradients: no reduction, no step due
        if (self._backward_done and not local and self.config.managed_gradient_accumulation
                and self._boundary_override is None):
            raise RuntimeError("zerocore: backward() called twice without step(); call engine.step() after "
                               "every micro-batch's backward (it only updates at the accumulation boundary)")
        boundary = self.is_gradient_accumulation_boundary() and not local
        if late:
            self.reducer.check_late(grad_factor)
        if self.gatherer is not None:
            self.gatherer.begin_backward()
        self.reducer.begin_backward(boundary, grad_factor, late)
        self._bracket = bracket

    def _finish_backward(self) -> None:
        """Closes the open backward: its reductions completed (aborted if one raises)."""
        try:
            self.reducer.finish_backward()
        except BaseException:
            self._abort_backward()
            raise
        self._bracket = CLOSED
        if self.gatherer is not None:
            self.gatherer.end_backward()
        # (coalesced_reduction.py sets it when the block ends; an engine that trains nothing has no step to wait
        # for: a backward through it only brings gradients to its inputs, trains_nothing.py)
        if self.trains and not (self._in_no_sync or self._coalescing):
            self._backward_done = True
            if not self.config.managed_gradient_accumulation:
                self._window_backwards += 1
        self._dropped = False

    def _abort_backward(self) -> None:
        """A backward that raised: the gradients as they were before it (GradReducer.abort)."""
        self._bracket = CLOSED
        try:
            self.reducer.abort()
        finally:
            if self.gatherer is not None:
                self.gatherer.free_all()
