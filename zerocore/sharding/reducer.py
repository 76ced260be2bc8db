"""GradReducer: gradients from autograd hooks into flat buckets, buckets reduced as they fill.

``register_post_accumulate_grad_hook`` fires once per parameter per backward, after autograd
has accumulated its gradient. Stages 0/1 keep a full gradient buffer per group (``.grad`` is a
view of it, so micro-batches accumulate in place) and reduce it at the accumulation boundary.
Stage 2 takes each gradient from ``.grad`` as it arrives; when a group's last gradient is in,
one multi-tensor ``pack`` call copies them all into a transient bucket (zeroing the slots of
unused parameters and the padding in the same pass), the bucket is reduced, and the owned
slice is added into the gradient shard. Packing per group rather than per hook keeps the
hook itself to a few microseconds (it was most of the cost of a 200-tensor model at 4 MB).

Groups are launched strictly in index order (group k only after groups < k), whatever order
the hooks fire in, so every rank issues the same collectives in the same order even when
ranks use different parameters (unused ones are reduced as zeros at the end of backward).
With ``overlap`` up to two buckets are in flight while backward continues; gloo's async Work
is only ever completed through ``wait()`` (it never reports ``is_completed()``).
"""
from __future__ import annotations

from collections import deque

import torch

from .. import ops
from ..comm import Comm, Handle
from .group import ShardedGroup
from .state import GradState


class BucketPool:
    """Transient stage-2 buckets, all ``numel`` long, at most ``cap`` of them (2 with
    overlap_comm: one reducing while the next is packed)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, cap: int):
        self.numel, self.dtype, self.device, self.cap = numel, dtype, device, cap
        self.free: list[torch.Tensor] = []
        self.all: list[torch.Tensor] = []

    def take(self) -> torch.Tensor | None:
        if self.free:
            return self.free.pop()
        if len(self.all) < self.cap:
            b = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            self.all.append(b)
            return b
        return None

    def give(self, b: torch.Tensor) -> None:
        self.free.append(b)


class GradReducer:
    def __init__(self, groups: list[ShardedGroup], comm: Comm, *, overlap: bool, reduce_scatter: bool,
                 device: torch.device):
        self.groups = groups
        self.comm = comm
        self.overlap = overlap
        # reduce_scatter False = DeepSpeed's all-reduce of whole buckets; on gloo the comm layer
        # runs both as an all-reduce (measured faster there). Stage 0 steps the whole group on
        # every rank, so it needs the whole sum: always an all-reduce.
        sharded = bool(groups) and groups[0].policy.shard_optimizer
        self._reduce = comm.reduce_scatter if reduce_scatter and sharded else comm.all_reduce
        self.full_grads = bool(groups) and groups[0].policy.keep_full_grads
        self.slot_of: dict[int, tuple[int, int]] = {}
        for g in groups:
            for i, p in enumerate(g.params):
                self.slot_of[id(p)] = (g.index, i)
        self.pool = None
        if groups and not self.full_grads:
            self.pool = BucketPool(max(g.layout.padded for g in groups), groups[0].layout.dtype, device,
                                   cap=2 if overlap else 1)
        self.buckets: dict[int, torch.Tensor] = {}  # group -> its bucket while reducing (stage 2)
        self.inflight: deque[tuple[int, Handle]] = deque()
        # stage 2: this micro-batch's gradients, held from their hook until their group is packed
        self.stash: list[list[torch.Tensor | None]] = [[None] * len(g.params) for g in groups]
        self.arrived = [[False] * len(g.params) for g in groups]
        self.count = [0] * len(groups)
        self.launched = [False] * len(groups)
        self.next_launch = 0
        self.reducing = False  # does this backward reduce (always at stage 2; at the boundary at 0/1)?
        self.in_backward = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for g in groups for p in g.params]
        for g in groups:
            g.bind_grads()

    # -- backward ------------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        if self.in_backward:
            raise RuntimeError("zerocore: backward called again before the previous one finished")
        self.in_backward = True
        self.reducing = boundary or not self.full_grads
        self.arrived = [[False] * len(g.params) for g in self.groups]
        self.count = [0] * len(self.groups)
        self.launched = [False] * len(self.groups)
        self.next_launch = 0

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self.in_backward:
            raise RuntimeError("zerocore: a gradient arrived outside engine.backward(); call engine.backward(loss) "
                               "instead of loss.backward() so loss scaling and gradient reduction happen")
        k, i = self.slot_of[id(p)]
        g = self.groups[k]
        if self.launched[k]:
            raise RuntimeError(f"zerocore: gradient of '{g.layout.slots[i].name}' arrived after its bucket was "
                               "reduced (a second backward through it?); reentrant backward is not supported")
        if self.full_grads:
            view = g.grad_view(i)
            if p.grad.data_ptr() != view.data_ptr():  # .grad was reset to None behind our back
                view.copy_(p.grad)
                p.grad = view
            if g.grad_state == GradState.EMPTY:
                g.grad_state.to(GradState.FILLING)
        else:
            if g.grad_state != GradState.FILLING:
                g.grad_state.to(GradState.FILLING)
            prev = self.stash[k][i]  # a parameter reached twice (reentrant checkpointing): sum
            self.stash[k][i] = p.grad if prev is None else prev + p.grad
            p.grad = None  # stage 2 keeps only the owned slice
        if self.arrived[k][i]:
            return
        self.arrived[k][i] = True
        self.count[k] += 1
        if self.reducing and k == self.next_launch and self.count[k] == len(g.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.groups):
            k = self.next_launch
            if self.count[k] < len(self.groups[k].params):
                return
            self._launch(k)

    def _launch(self, k: int) -> None:
        g = self.groups[k]
        if g.grad_state != GradState.FILLING:  # no parameter of this group got a gradient
            g.grad_state.to(GradState.FILLING)
        if self.full_grads:
            flat = g.grad_full
        else:
            b = self.pool.take()
            while b is None:  # both buckets busy: the oldest reduction must land first
                self._finish_oldest()
                b = self.pool.take()
            flat = b[:g.layout.padded]
            stash, tensors, offsets = self.stash[k], [], []
            for slot, grad in zip(g.layout.slots, stash):
                if grad is not None:
                    if grad.dtype != flat.dtype or not grad.is_contiguous():
                        grad = grad.to(flat.dtype).contiguous()
                    tensors.append(grad.reshape(-1))
                    offsets.append(slot.offset)
            # one pass: every gradient into place, unused slots and the padding zeroed
            ops.pack(tensors, offsets, flat)
            self.stash[k] = [None] * len(stash)
            self.buckets[k] = b
        g.grad_state.to(GradState.REDUCING)
        self.launched[k] = True
        self.next_launch = k + 1
        handle = self._reduce(flat, async_op=self.overlap)
        self.inflight.append((k, handle))
        if not self.overlap:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        k, handle = self.inflight.popleft()
        handle.wait()
        g = self.groups[k]
        if not self.full_grads:
            b = self.buckets.pop(k)
            mine = b[g.lo:g.hi]
            if g.has_grad:
                g.grad_shard.add_(mine)
            else:
                g.grad_shard.copy_(mine)
            self.pool.give(b)
        g.has_grad = True
        g.grad_state.to(GradState.HELD)

    def finish_backward(self) -> None:
        """Reduces whatever is still pending (groups with unused parameters) and waits for every
        reduction, so the owned gradient slices are complete."""
        if not self.in_backward:
            return
        try:
            if self.reducing:
                while self.next_launch < len(self.groups):
                    self._launch(self.next_launch)
            while self.inflight:
                self._finish_oldest()
        finally:
            self.in_backward = False
            self.stash = [[None] * len(g.params) for g in self.groups]

    def clear(self) -> None:
        """Forgets all gradients of this optimizer step."""
        if self.in_backward or self.inflight:
            raise RuntimeError("zerocore: zero_grad() during backward")
        for g in self.groups:
            g.clear_grads()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def bucket_tensors(self) -> list[torch.Tensor]:
        return list(self.pool.all) if self.pool is not None else []
