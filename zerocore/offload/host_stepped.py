"""What every optimizer shard stepped on the host shares, whatever storage its state rests in
(host memory: ``HostOptimizerShard``; NVMe swap files: ``nvme.NvmeOptimizerShard``).

- the landed gradient: the reduced owned gradient's host part copied to ``grad_h`` (``land``), and
  this group's contribution to the global norm and overflow flag (``landed_sumsq``), computed where the
  gradient was reduced (on a GPU: a kernel over the whole owned range as it lands, no host pass);
- the host step's hand-off: queued for the worker at stage 3 (``enqueue``, set by OffloadPlan),
  else run now (``_run_host``), its updated parameters copied back to the device (``_copy_back``);
- the owned parameters a step writes: the group's own, or its shard swapped in from NVMe
  (``_params``, with ``param_swap`` set by OffloadPlan).

Each subclass calls ``__init__`` with its host part's size (``split``: the owned range's elements
[0, split) are stepped on the host; the rest, if any, on the device).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from .._weak import back_ref
from ..sharding.group import ShardedGroup
from .device_norms import LandedNorm
from .host_memory import host_zeros
from .stepper import Ready


class HostSteppedShard:
    batched = False  # its own step (the host part on the worker or inline): see OptimizerShard
    reads_ahead = False
    tiles_kept = True  # the host shard's tiles are views of its state
    group = back_ref()  # the group this shard steps (the engine owns it; see OptimizerShard.group)
    # the BatchSpeculation this shard takes part in (offload/speculation.py); its owner (a HostStepBatch, or the
    # engine's list for stage 3's units) holds it, and it holds this shard: weak here, or the two would be a cycle
    speculation = back_ref()

    def __init__(self, group: ShardedGroup, *, split: int, pin: bool):
        self.group = group
        self.pin = pin
        self.split = split  # host part: [0, split) of the owned range
        self.half = group.layout.dtype != torch.float32
        self.grad_h = host_zeros(split, group.layout.dtype, pin)  # the landed gradient's host part
        self.ready = Ready()  # this step's host update is in the parameters
        self._landed: list = []  # (cuda event | None) for the gradient copy in flight
        self._copy_stream = None
        self._copy_event = None  # the last copy back to the device (CUDA)
        self.sumsq, self.nonfinite = 0.0, False
        self._norm = None  # the landed gradient's (sum of squares, flag), not yet read (device_norms.LandedNorm)
        self.enqueue = None  # (group index, host step, ready) -> None: set by OffloadPlan at stage 3
        self.run_now = None  # the same, run on the worker and waited for: OffloadPlan, stages 1/2 on a GPU
        self.run_later = None  # the same, run on the worker, not waited for (a speculative step): OffloadPlan
        self.speculation = None
        self.param_swap = None  # set by OffloadPlan when this group's parameter shard rests on NVMe
        self.pieces = None  # hyper-parameter groups of the owned range (sharding.optimizer.Pieces)

    # -- gradients arrive ------------------------------------------------------------------
    def land(self, grad: torch.Tensor) -> None:
        """The reduced owned gradient is final for this step: the host part goes to host memory (a
        side-stream copy tracked by an event on CUDA), and the (sum of squares, Inf/NaN) of the whole
        owned range is computed where the gradient is (``LandedNorm``: on a GPU a kernel launched now,
        its two values read with the boundary's other groups' in one copy, ``device_norms.fetch``).
        On a GPU that replaced a host pass over ``grad_h`` (10-25 ms a step for a 337M model's shard on
        16 cores: the host's memory bandwidth, which the host Adam needs); it also sums the range in
        one piece, the order the engine without offload sums it in."""
        self.ready.wait()  # the worker may still be reading last step's landed gradient
        if self.speculation is not None:  # ... or a speculative step from it
            self.speculation.before_land()
        h = self.split
        self._norm = LandedNorm(grad)
        if grad.device.type == "cuda":
            stream = self._stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.grad_h.copy_(grad[:h], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            grad.record_stream(stream)
            self._landed.append(ev)
        else:
            ev = None
            # a CPU device: the copy is done when copy_ returns (non_blocking changes nothing on the CPU; said
            # so that zerocore.debug.host_waits meets the same code a CUDA device runs: a copy not waited for)
            self.grad_h.copy_(grad[:h], non_blocking=True)
        if self.releases_grad:  # nothing reads the device gradient after this: its memory goes back
            self.group.release_grad()
        if self.speculation is not None:  # the batch's host step may start once all its gradients landed
            self.speculation.landed(self, ev)

    @property
    def releases_grad(self) -> bool:
        """Whether the device's reduced gradient is done with once landed: the host steps the whole owned
        range (no device part reads it), with zerocore's Adam (which only reads the landed copy, so the
        copy can give the values back: ShardedGroup.reacquire_grad; a client torch optimizer scales it in
        place), and it is the group's own shard (stages 2/3; stages 0/1 keep the full buffer the
        parameters' ``.grad`` are views of)."""
        g = self.group
        return (self.split == g.hi - g.lo and getattr(self, "kernel", None) is None and g.grad_full is None
                and g.grad_shard is not None)

    def landed_copy(self) -> torch.Tensor:
        """The landed gradient's host copy, complete (the host waits on its copy's event, not on the
        device): what ``ShardedGroup.reacquire_grad`` restores a released device gradient from."""
        for ev in self._landed:
            ev.synchronize()
        return self.grad_h

    def pending_norm(self) -> LandedNorm | None:
        """The landed gradient's norm pair not yet read (``device_norms.fetch`` reads many at once)."""
        return self._norm

    def landed_sumsq(self) -> tuple[float, bool]:
        """This group's (sum of squares, any Inf/NaN) of the owned reduced gradient; the host part's
        copy is complete when it returns (the host step reads ``grad_h`` next)."""
        for ev in self._landed:
            ev.synchronize()  # the host waits on the copies this step needs, not on the device
        self._landed.clear()
        if self._norm is not None:
            s, bad = self._norm.get()
            self.sumsq, self.nonfinite = s, bool(bad)
            self._norm = None
        return self.sumsq, self.nonfinite

    def _stream(self):
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        return self._copy_stream

    # -- the step --------------------------------------------------------------------------
    def _params(self, step: int, *, whole: bool = True):
        """(a context) The owned parameters a step or a refresh writes: the group's own, or its shard
        swapped in from NVMe for the block and written back behind it (``ParamSwap.held``; ``whole``:
        the block writes every element, so the old values need not be read)."""
        if self.param_swap is None:
            return contextlib.nullcontext(self.group.owned_params_raw())
        return self.param_swap.held(self.group.index, step, overwrite=whole)

    def _run_host(self, host_part):
        """Stage 3: queued for the worker, in the next forward's order; else stepped now, on the
        worker (``run_now``) or on this thread (the device stream waits for its copy back)."""
        hand_over = self.enqueue or self.run_now
        if hand_over is not None:
            group = self.group
            # the queued step keeps its group alive until it has run (this shard reaches the group
            # weakly): an engine dropped right after step() is freed once its queued steps are done
            hand_over(group.index, functools.partial(_keeping, group, host_part), self.ready)
            return None
        ev = host_part()
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)
        return None

    def wait_copy_back(self) -> None:
        """Waits (the host, on the event) for the last copy of this shard's values to the device: the next
        host step writes the buffer it reads."""
        if self._copy_event is not None:
            self._copy_event.synchronize()
            self._copy_event = None

    def _copy_back(self, dst: torch.Tensor, src: torch.Tensor | None):
        """Updated host values ``src`` into the device parameters ``dst`` (nothing to do when there
        are none or they already are them). Returns the copy's CUDA event, or None."""
        stream = self._stream() if dst.device.type == "cuda" else None
        if not self._queue_copy_back(dst, src, stream):
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        self._copy_event = ev
        return ev

    @staticmethod
    def _queue_copy_back(dst: torch.Tensor, src: torch.Tensor | None, stream) -> bool:
        """``src`` into ``dst``: on a CPU device done when this returns, on CUDA queued on ``stream``
        (True: the caller records the event the next step waits for). False where there is nothing
        to copy (no values, or ``src`` is ``dst``)."""
        if src is None or src.data_ptr() == dst.data_ptr():
            return False
        if dst.device.type != "cuda":
            dst.copy_(src)
            return False
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        return True


def _keeping(group, fn):
    """Runs ``fn``; ``group`` is only held (see ``HostSteppedShard._run_host``)."""
    return fn()
