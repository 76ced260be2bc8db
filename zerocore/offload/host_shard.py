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

import torch

from .. import ops
from ..sharding.group import ShardedGroup
from ..sharding.optimizer import clip_plan, step_plan
from .host_memory import host_copy, host_empty, host_zeros
from .host_stepped import HostSteppedShard


def _pinned(t: torch.Tensor) -> bool:
    try:
        return t.is_pinned()
    except RuntimeError:  # no accelerator to ask
        return False


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


class HostOptimizerShard(HostSteppedShard):
    """The host part's state (master, m, v) in host memory; the device part's on the device."""

    def __init__(self, group: ShardedGroup, init_fp32: torch.Tensor, *, ratio: float, pin: bool,
                 tile: int | None = None, params_swapped: bool = False):
        n = group.hi - group.lo
        super().__init__(group, split=n if ratio >= 1.0 else int(round(n * ratio)), pin=pin)
        owned = init_fp32 if init_fp32.numel() == n else init_fp32[group.lo:group.hi]
        self.tile = tile or max(n, 1)
        target = group.owned_params()
        h = self.split
        # host part. fp32 training with the parameters already in host memory (stage-3 param offload, or a
        # CPU training device): the master *is* the parameter, as on the device (no copy back); not
        # when the parameter shard rests on NVMe (its host buffer is reused for other groups).
        self.master_is_param = not self.half and target.device.type == "cpu" and not params_swapped
        if self.master_is_param:
            self.master_h = target[:h]
        else:
            self.master_h = host_copy(owned[:h].to("cpu"), pin)
        self.exp_avg_h = host_zeros(h, torch.float32, pin)
        self.exp_avg_sq_h = host_zeros(h, torch.float32, pin)
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
        self.kernel = None  # (master, grad, out, grad_scale) -> None replacing Adam: a client torch optimizer
        # the speculative step's second set of host state and its 16-bit output (offload/speculation.py)
        self.state_sets = None  # [(master, m, v), (master, m, v)]: ``current`` is the one in use
        self.current = 0
        self.spec_out = None

    # -- the speculative step's buffers (offload/speculation.py) --------------------------------
    def make_spare(self) -> None:
        """A second master, m and v (the speculative step writes them), and where its 16-bit values go:
        the staging buffer, or one of its own where the step otherwise writes host parameters in place."""
        if self.state_sets is not None:
            return
        h = self.split
        spare = tuple(host_zeros(h, torch.float32, self.pin) for _ in range(3))
        self.state_sets = [(self.master_h, self.exp_avg_h, self.exp_avg_sq_h), spare]
        self.current = 0
        if self.half:  # (host-resident parameters: pinned as they are, since it may become the parameter shard)
            target = self.group.owned_params_raw()
            pin = self.pin or (target.device.type == "cpu" and _pinned(target))
            self.spec_out = self.out_h if self.out_h is not None else host_empty(h, self.group.layout.dtype, pin)

    def swap_spare(self) -> None:
        """The speculative step's output becomes the state (its old buffers the next one's output)."""
        self.current = 1 - self.current
        self.master_h, self.exp_avg_h, self.exp_avg_sq_h = self.state_sets[self.current]

    def _state_written(self) -> None:
        """The current state is written from outside the step (a checkpoint load): a speculative step
        read the old values, so it is dropped."""
        if self.speculation is not None:
            self.speculation.drop()

    # -- the step --------------------------------------------------------------------------
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
            self.wait_copy_back()  # last step's copy back still reads the buffer we write
            with self._params(step, whole=whole) as target:
                out = target[:h] if self.half and self.out_h is None else self.out_h
                if self.kernel is not None:  # a client torch optimizer (runtime/torch_shard_step.py)
                    self.kernel(self.master_h, self.grad_h, out, grad_scale)
                else:
                    _adam(self.master_h, self.grad_h, self.exp_avg_h, self.exp_avg_sq_h, out, plan, step, grad_scale,
                          self.tile)
                return self._copy_back(target[:h], self.out_h if self.half else self.master_h)

        if self.speculation is not None and self.enqueue is not None:  # stage 3: keep or replace a speculation
            return self._run_host(self.speculation.queued_step(hp, step, grad_scale, host_part))
        return self._run_host(host_part)

    def commit_speculation(self):
        """A kept speculation's 16-bit values (or fp32 master) into the parameters. Stage 3 with the
        parameter shard in host memory (a CPU device, or offload_param): the output buffer becomes the
        shard and the old shard the next speculation's output (nothing copied: the copy of 2 bytes a
        parameter cost 9 ms a step of a 25M model on this project's CPU, on the path of the next forward);
        else the host copy, or the copy back to the device (returns its CUDA event, or None)."""
        g = self.group
        if self.half and g.partitioned and g.param_shard.device.type == "cpu" and g.param_shard.numel() == self.split:
            g.param_shard, self.spec_out = self.spec_out, g.param_shard
            return None
        return self._copy_back(g.owned_params_raw()[:self.split], self.speculative_src())

    def speculative_src(self) -> torch.Tensor:
        """What a kept speculation puts in the parameters: its 16-bit output, or the fp32 master (now
        the speculation's output) for fp32 training."""
        return self.spec_out if self.half else self.master_h

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
        self._state_written()
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
        if write:
            self._state_written()
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
                "host_params": None if self.param_swap is None else self.param_swap.pool,
                **self._spare_tensors()}

    def _spare_tensors(self) -> dict[str, torch.Tensor | None]:
        if self.state_sets is None:
            return {}
        spare = self.state_sets[1 - self.current]
        return {"host_spare_master": spare[0], "host_spare_exp_avg": spare[1], "host_spare_exp_avg_sq": spare[2],
                "host_spare_out": self.spec_out if self.spec_out is not self.out_h else None}
