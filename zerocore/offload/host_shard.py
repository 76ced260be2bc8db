"""The owned optimizer state of one flat group with all of it (``ratio`` 1) or its first
``ratio`` fraction on the host ("twin-flow" below 1: the rest stays on the training device and
is stepped there by the device kernel).

The engine's contract is OptimizerShard's: ``step(grad, hyper, step=, grad_scale=)`` and
``tensors()``. What differs is where the bytes rest: fp32 master, m, v and a landed copy of the
reduced gradient (``land``) of the host part live in host memory; the Adam step of the host part
runs the same SIMD kernel, writing the 16-bit parameters in the same pass (``param_out``)
straight into the parameters when they are host memory (a CPU device, or stage-3 parameter
offload), else into a host staging buffer copied to the device on a side stream (an event).
"""
from __future__ import annotations

import contextlib

import torch

from .. import ops
from ..sharding.group import ShardedGroup
from ..sharding.optimizer import clip_plan, step_plan
from .host_memory import host_copy, host_empty, host_zeros
from .stepper import Ready


def _adam(master, grad, m, v, out, plan, step: int, grad_scale: float, tile: int, base: int = 0) -> None:
    """Adam over tensors holding the owned range's elements [base, base + len): ``plan`` (see
    ``step_plan``, owned-range coordinates) says which hyper-parameters each element takes."""
    n = master.numel()
    for lo, hi, hp in clip_plan(plan, base, base + n):
        for a in range(lo, hi, tile):
            b = min(hi, a + tile)
            ops.adam_step(master[a:b], grad[a:b], m[a:b], v[a:b], lr=hp.lr, betas=hp.betas, eps=hp.eps,
                          weight_decay=hp.weight_decay, step=step, adamw_mode=hp.decoupled, grad_scale=grad_scale,
                          param_out=None if out is None else out[a:b])


class HostOptimizerShard:
    batched = False  # its own step (the host part on the worker or inline): see OptimizerShard
    reads_ahead = False

    def __init__(self, group: ShardedGroup, init_fp32: torch.Tensor, *, ratio: float, pin: bool,
                 tile: int | None = None, params_swapped: bool = False):
        self.group = group
        self.pin = pin
        n = group.hi - group.lo
        owned = init_fp32 if init_fp32.numel() == n else init_fp32[group.lo:group.hi]
        self.split = n if ratio >= 1.0 else int(round(n * ratio))  # host part: [0, split) of the owned range
        self.half = group.layout.dtype != torch.float32
        self.tile = tile or max(n, 1)
        target = group.owned_params()
        h = self.split
        # host part. fp32 training with the parameters already in host memory (stage-3 param offload, or a
        # CPU training device): the master *is* the parameter, as on the device (no copy back); not
        # when the parameter shard rests on NVMe (its host buffer is reused for other groups).
        if not self.half and target.device.type == "cpu" and not params_swapped:
            self.master_h = target[:h]
        else:
            self.master_h = host_copy(owned[:h].to("cpu"), pin)
        self.exp_avg_h = host_zeros(h, torch.float32, pin)
        self.exp_avg_sq_h = host_zeros(h, torch.float32, pin)
        self.grad_h = host_zeros(h, group.layout.dtype, pin)
        # 16-bit values from the host kernel: straight into host-resident parameters, else staged
        self.out_h = None
        if self.half and target.device.type != "cpu":
            self.out_h = host_empty(h, group.layout.dtype, pin)
        # device part (ratio < 1): as OptimizerShard keeps it
        tail = owned[h:]
        if h == n:
            self.master_d = torch.empty(0, dtype=torch.float32, device=owned.device)
        elif not self.half and target.device == tail.device and not params_swapped:
            self.master_d = target[h:]
        else:
            self.master_d = tail.clone()
        self.exp_avg_d = torch.zeros_like(self.master_d)
        self.exp_avg_sq_d = torch.zeros_like(self.master_d)
        self.ready = Ready()  # this step's host update is in the parameters
        self._landed: list = []  # (cuda event | None) for the gradient copy in flight
        self._copy_stream = None
        self._copy_event = None  # the last copy back to the device (CUDA)
        self.sumsq, self.nonfinite = 0.0, False
        self._host_norm_pending = False  # a device gradient copy in flight: the host part of the norm waits
        self.enqueue = None  # (group index, host step, ready) -> None: set by OffloadPlan at stage 3
        self.param_swap = None  # set by OffloadPlan when this group's parameter shard rests on NVMe
        self.pieces = None  # hyper-parameter groups of the owned range (sharding.optimizer.Pieces)
        self.kernel = None  # (master, grad, out, grad_scale) -> None replacing Adam: a client torch optimizer

    # -- gradients arrive ------------------------------------------------------------------
    def land(self, grad: torch.Tensor) -> None:
        """The reduced owned gradient is final for this step: the host part goes to host memory (a
        side-stream copy tracked by an event on CUDA) and its contribution to the global norm and
        overflow flag is accumulated (the device part's on the device)."""
        self.ready.wait()  # the worker may still be reading last step's landed gradient
        h = self.split
        s, bad = (ops.sum_squares(grad[h:]) if h < grad.numel() else (0.0, False))
        if grad.device.type == "cuda":
            stream = self._stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.grad_h.copy_(grad[:h], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            grad.record_stream(stream)
            self._landed.append(ev)
            self.sumsq, self.nonfinite = s, bad  # the host part is added when its copy has landed
            self._host_norm_pending = True
            return
        self.grad_h.copy_(grad[:h])
        hs, hbad = ops.sum_squares(self.grad_h)
        self.sumsq, self.nonfinite = hs + s, bool(hbad or bad)
        self._host_norm_pending = False

    def landed_sumsq(self) -> tuple[float, bool]:
        """This group's (sum of squares, any Inf/NaN) of the owned reduced gradient."""
        if self._host_norm_pending:
            for ev in self._landed:
                ev.synchronize()
            self._landed.clear()
            hs, hbad = ops.sum_squares(self.grad_h)
            s, bad = self.sumsq, self.nonfinite
            self.sumsq, self.nonfinite = hs + s, bool(hbad or bad)
            self._host_norm_pending = False
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

    def step(self, grad: torch.Tensor, hp: AdamHyper, *, step: int, grad_scale: float):
        """Steps the device part now; the host part now too, or (with ``enqueue`` set, stage 3) hands
        it to be queued for the worker. ``grad``: the device's owned gradient (the device part reads it;
        the host part reads its landed copy)."""
        plan = step_plan(self.pieces, grad.numel(), hp)  # copies: the worker sees this step's values
        h = self.split
        if h < grad.numel():
            with self._params(step, whole=h == 0) as target:
                self._device_part(grad, plan, step, grad_scale, target)
        if h == 0:
            return None
        whole = h == grad.numel()  # the host part writes every element of the owned range

        def host_part():
            if self._copy_event is not None:  # last step's copy back still reads the buffer we write
                self._copy_event.synchronize()
                self._copy_event = None
            with self._params(step, whole=whole) as target:
                out = target[:h] if self.half and self.out_h is None else self.out_h
                if self.kernel is not None:  # a client torch optimizer (runtime/torch_shard_step.py)
                    self.kernel(self.master_h, self.grad_h, out, grad_scale)
                else:
                    _adam(self.master_h, self.grad_h, self.exp_avg_h, self.exp_avg_sq_h, out, plan, step, grad_scale,
                          self.tile)
                return self._copy_back(target[:h])

        return self._run_host(host_part)

    def _device_part(self, grad, plan, step: int, grad_scale: float, target: torch.Tensor) -> None:
        h = self.split
        dev_out = target[h:] if self.half else None
        if dev_out is not None and dev_out.device != self.master_d.device:
            dev_out = torch.empty_like(self.master_d, dtype=target.dtype)
        _adam(self.master_d, grad[h:], self.exp_avg_d, self.exp_avg_sq_d, dev_out, plan, step, grad_scale,
              self.tile, base=h)
        if not self.half and self.master_d.data_ptr() != target[h:].data_ptr():
            target[h:].copy_(self.master_d)
        elif dev_out is not None and dev_out.data_ptr() != target[h:].data_ptr():
            target[h:].copy_(dev_out)

    def _run_host(self, host_part):
        """Stage 3: queued for the worker, in the next forward's order; else stepped now (the device
        stream waits for its copy back). Also NvmeOptimizerShard's."""
        if self.enqueue is not None:
            self.enqueue(self.group.index, host_part, self.ready)
            return None
        ev = host_part()
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)
        return None

    def _copy_back(self, dst: torch.Tensor, src: torch.Tensor | None = None):
        """Updated host values (``src``, default the 16-bit output or the master) into the device
        parameters (nothing to do when they already are them)."""
        src = src if src is not None else self.out_h if self.half else self.master_h
        if src is None or src.data_ptr() == dst.data_ptr():
            return None
        if dst.device.type != "cuda":
            dst.copy_(src)
            return None
        stream = self._stream()
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        self._copy_event = ev
        return ev

    # -- what the engine and checkpoints read ------------------------------------------------
    @property
    def master(self) -> torch.Tensor:
        """The fp32 master of the owned range (a copy joined from both parts when ``ratio`` < 1)."""
        self.ready.wait()
        if self.master_d.numel() == 0:
            return self.master_h
        return torch.cat([self.master_h.to(self.master_d.device), self.master_d])

    def load_master(self, a: int, b: int, values: torch.Tensor) -> None:
        """Writes ``values`` into the master's owned-range elements [a, b)."""
        self.ready.wait()
        if self.param_swap is not None:  # zerocore.gathered wrote the resident shard first
            self.param_swap.mark_dirty(self.group.index)
        h = self.split
        if a < h:
            self.master_h[a:min(b, h)].copy_(values[:min(b, h) - a])
        if b > h:
            self.master_d[max(a, h) - h:b - h].copy_(values[max(a, h) - a:])

    def state_tiles(self, max_elems: int, *, write: bool = False):
        """(lo, hi, {"master", "exp_avg", "exp_avg_sq"}) over the owned range, at most ``max_elems`` per
        tile and never across the host/device split; the tensors are views of the state, so what a
        writer puts into them with ``write`` is the state."""
        self.ready.wait()
        parts = [(0, self.master_h, self.exp_avg_h, self.exp_avg_sq_h),
                 (self.split, self.master_d, self.exp_avg_d, self.exp_avg_sq_d)]
        for base, m, a, v in parts:
            for lo in range(0, m.numel(), max(1, max_elems)):
                hi = min(m.numel(), lo + max_elems)
                yield base + lo, base + hi, {"master": m[lo:hi], "exp_avg": a[lo:hi], "exp_avg_sq": v[lo:hi]}

    def refresh_params(self) -> None:
        """Re-derives the owned 16-bit (or fp32) parameters from the master (after a checkpoint load)."""
        self.ready.wait()
        h = self.split
        with self._params(0) as target:
            for m, dst in ((self.master_h, target[:h]), (self.master_d, target[h:])):
                if m.numel() and m.data_ptr() != dst.data_ptr():
                    dst.copy_(m)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"host_master": self.master_h, "host_exp_avg": self.exp_avg_h, "host_exp_avg_sq": self.exp_avg_sq_h,
                "host_grads": self.grad_h, "host_staging": self.out_h, "master": self.master_d,
                "exp_avg": self.exp_avg_d, "exp_avg_sq": self.exp_avg_sq_d,
                "host_params": None if self.param_swap is None else self.param_swap.pool}
