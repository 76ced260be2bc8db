"""GradReducer: gradients from autograd hooks into flat buckets, buckets reduced as they fill.

``register_post_accumulate_grad_hook`` fires once per parameter per backward, after autograd
has accumulated its gradient. Stages 0/1 keep a full gradient buffer per group (``.grad`` is a
view of it, so micro-batches accumulate in place) and reduce it at the accumulation boundary.
Stage 2 packs each gradient into its group's transient bucket as it arrives and frees
``.grad`` at once (so at most a bucket, not a group's worth of gradients, is alive on top of
the model), reduces every micro-batch, and adds the owned slice into the gradient shard.

Groups are launched strictly in index order (group k only after groups < k), whatever order
the hooks fire in, so every rank issues the same collectives in the same order even when
ranks use different parameters (unused ones reduce as zeros: at the end of the first backward
that meets them, and from then on as soon as a walk of the autograd graph shows them
unreachable, so they do not hold buckets back).
With ``overlap`` up to two buckets are in flight while backward continues; gloo's async Work
is only ever completed through ``wait()`` (it never reports ``is_completed()``).
"""
from __future__ import annotations

from collections import deque

import torch

from .. import ops
from ..comm import Comm, Handle
from ..comm.divergence import Op
from .group import ShardedGroup
from .state import GradState

BACKWARD_PHASE = 2  # comm.divergence.PHASES[2]


class BucketPool:
    """Transient stage-2 buckets, all ``numel`` long: at most ``cap`` (2 with overlap_comm: one
    reducing while the next fills), plus one more only when every bucket is still filling
    because hooks fired out of group order (counted in ``extra``)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, cap: int):
        self.numel, self.dtype, self.device, self.cap = numel, dtype, device, cap
        self.free: list[torch.Tensor] = []
        self.all: list[torch.Tensor] = []
        self.extra = 0

    def take(self, force: bool = False) -> torch.Tensor | None:
        if self.free:
            return self.free.pop()
        if len(self.all) < self.cap or force:
            self.extra += len(self.all) >= self.cap
            b = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            self.all.append(b)
            return b
        return None

    def give(self, b: torch.Tensor) -> None:
        self.free.append(b)

    def trim(self) -> None:
        """Frees free buckets beyond ``cap``."""
        while len(self.all) > self.cap and self.free:
            b = self.free.pop()
            self.all = [x for x in self.all if x is not b]


def reachable_leaves(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors whose gradient ``loss.backward()`` will produce."""
    seen, out = set(), set()
    stack = [loss.grad_fn] if loss.grad_fn is not None else []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf
        if var is not None:
            out.add(id(var))
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return out


class GradReducer:
    def __init__(self, groups: list[ShardedGroup], comm: Comm, *, overlap: bool, reduce_scatter: bool,
                 device: torch.device, guard=None, on_complete=None, on_reduced=None):
        """``guard``: a DivergenceGuard checked before each reduction (stage 3); ``on_complete(k)``:
        called once per backward when group k has every gradient (stage 3 frees the unit);
        ``on_reduced(k)``: called when group k's owned reduced slice is final for this micro-batch
        (offload moves it to the host)."""
        self.groups = groups
        self.comm = comm
        self.guard = guard
        self.on_complete = on_complete
        self.on_reduced = on_reduced
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
        self.buckets: dict[int, torch.Tensor] = {}  # group -> its bucket while filling/reducing (stage 2)
        self.inflight: deque[tuple[int, Handle]] = deque()
        self.arrived = [[False] * len(g.params) for g in groups]
        self.count = [0] * len(groups)
        self.launched = [False] * len(groups)
        self.next_launch = 0
        self.reducing = False  # does this backward reduce (always at stage 2; at the boundary at 0/1)?
        self.in_backward = False
        # Walk the graph for unused parameters before each backward; turned on the first time
        # a backward ends with parameters that got no gradient (DDP's find_unused_parameters,
        # found out instead of asked for).
        self.find_unused = False
        self.unreached = [[False] * len(g.params) for g in groups]
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for g in groups for p in g.params]
        for g in groups:
            g.bind_grads()

    # -- backward ------------------------------------------------------------------------
    def begin_backward(self, boundary: bool, loss: torch.Tensor | None = None) -> None:
        """Starts a backward. With ``loss`` given and unused parameters seen before, the autograd
        graph is walked first and parameters it cannot reach count as done (their slots reduce
        as zeros), so a group with an unused parameter launches when its used ones are in,
        instead of holding its bucket until the end of backward."""
        if self.in_backward:
            raise RuntimeError("zerocore: backward called again before the previous one finished")
        self.in_backward = True
        self.reducing = boundary or not self.full_grads
        self.arrived = [[False] * len(g.params) for g in self.groups]
        self.count = [0] * len(self.groups)
        self.unreached = [[False] * len(g.params) for g in self.groups]
        self.launched = [False] * len(self.groups)
        self.next_launch = 0
        if self.find_unused and loss is not None:
            reached = reachable_leaves(loss)
            for k, g in enumerate(self.groups):
                for i, p in enumerate(g.params):
                    if id(p) not in reached:
                        self.unreached[k][i] = True
                        self.count[k] += 1
                if self.count[k] == len(g.params) and self.on_complete is not None:
                    self.on_complete(k)
            if self.reducing:
                self._launch_ready()  # groups with nothing reachable go now

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
            slot = g.layout.slots[i]
            dst = self._bucket(k)[slot.offset:slot.end]
            grad = p.grad.reshape(-1)
            if self.arrived[k][i]:  # reached twice in one backward (reentrant checkpointing): sum
                dst.add_(grad)
            elif grad.dtype == dst.dtype and grad.is_contiguous():
                ops.pack([grad], [0], dst)
            else:
                dst.copy_(grad)
            p.grad = None  # stage 2 keeps only the owned slice
        if self.arrived[k][i]:
            return
        self.arrived[k][i] = True
        if self.unreached[k][i]:  # not in the graph at the start (reentrant checkpointing?) but came
            self.unreached[k][i] = False  # before its group launched: already counted
            return
        self.count[k] += 1
        if self.count[k] == len(g.params) and self.on_complete is not None:
            self.on_complete(k)
        if self.reducing and k == self.next_launch and self.count[k] == len(g.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.groups):
            k = self.next_launch
            if self.count[k] < len(self.groups[k].params):
                return
            self._launch(k)

    def _bucket(self, k: int) -> torch.Tensor:
        b = self.buckets.get(k)
        if b is not None:
            return b
        b = self.pool.take()
        while b is None and self.inflight:  # both buckets reducing: the oldest must land first
            self._finish_oldest()
            b = self.pool.take()
        if b is None:
            b = self.pool.take(force=True)
        g = self.groups[k]
        if g.grad_state != GradState.FILLING:
            g.grad_state.to(GradState.FILLING)
        self.buckets[k] = b
        return b

    def _launch(self, k: int) -> None:
        g = self.groups[k]
        if g.grad_state != GradState.FILLING:  # no parameter of this group got a gradient
            g.grad_state.to(GradState.FILLING)
        if self.full_grads:
            flat = g.grad_full
        else:
            b = self._bucket(k)
            if not all(self.arrived[k]):  # zero the slots no gradient was written to
                for slot, seen in zip(g.layout.slots, self.arrived[k]):
                    if not seen:
                        b[slot.offset:slot.end].zero_()
            b[g.layout.numel:g.layout.padded].zero_()  # a reused bucket may hold another group's data
            flat = b[:g.layout.padded]
        if self.guard is not None:
            self.guard.check(Op.REDUCE, k, BACKWARD_PHASE)
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
        if self.on_reduced is not None:
            self.on_reduced(k)

    def finish_backward(self) -> None:
        """Reduces whatever is still pending (groups with unused parameters) and waits for every
        reduction, so the owned gradient slices are complete."""
        if not self.in_backward:
            return
        try:
            if any(c < len(g.params) for c, g in zip(self.count, self.groups)):
                self.find_unused = True  # some parameter got no gradient: look for them from now on
            if self.reducing:
                while self.next_launch < len(self.groups):
                    self._launch(self.next_launch)
            while self.inflight:
                self._finish_oldest()
            if self.pool is not None:
                self.pool.trim()  # give back buckets made for out-of-order gradients
        finally:
            self.in_backward = False

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
