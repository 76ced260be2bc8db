"""A flat group at run time: the layout record plus the tensors one rank holds for it.

The model's parameters become views into ``param_flat`` (so the all-gather after the step
updates the model in place); with full gradients kept (stages 0/1) ``param.grad`` is a view
into ``grad_full`` too, so autograd accumulates micro-batches straight into the bucket.

Stage 3 (``policy.keep_full_params`` false) keeps the owned chunk in ``param_shard`` and
allocates ``param_flat`` only while gathered: its storage is resized to zero bytes when freed
and back when gathered (as FSDP2 does), so views of it that autograd saved during forward see
the re-gathered values in backward. While sharded, every parameter's ``.data`` is an empty
tensor (DeepSpeed's convention): a stray read fails on the shape instead of reading freed memory.
"""
from __future__ import annotations

import weakref
from itertools import repeat
from operator import attrgetter, is_not

import torch

from ..comm.collectives import DONE
from ..ops.params import param_ops
from .offloaded import GroupOffload
from .policy import StagePolicy
from .records import FlatGroup
from .state import GradState, ParamState, expect_all, grad_state, move_all, param_state


# Set on a stage-3 parameter whose values were dropped with its engine (only chunks of it existed):
# zerocore.initialize refuses it by name instead of training an empty tensor.
LOST_VALUES = "_zc_lost_values"


class ShardedGroup:
    def __init__(self, layout: FlatGroup, params: list[torch.nn.Parameter], policy: StagePolicy, rank: int,
                 device: torch.device, param_flat: torch.Tensor | None = None):
        assert len(params) == len(layout.slots)
        self.layout = layout
        self.params = params
        self.policy = policy
        parts = policy.partitions(layout.world)
        self.lo, self.hi = layout.range_of(rank if parts > 1 else 0, parts)
        if param_flat is None:
            param_flat = torch.zeros(layout.padded, dtype=layout.dtype, device=device)
        assert param_flat.numel() == layout.padded and param_flat.dtype == layout.dtype
        self.param_flat = param_flat
        self.param_state = param_state(layout.index, ParamState.GATHERED)
        self.partitioned = not policy.keep_full_params
        # Stage 3: the owned chunk of the parameters, the only part kept between uses.
        self.param_shard = param_flat[self.lo:self.hi].clone() if self.partitioned else None
        self._views: list[torch.Tensor] = []
        self._empty = torch.empty(0, dtype=layout.dtype, device=device)
        self.grad_state = grad_state(layout.index)
        # Stages 0/1: the full gradient buffer; stage 2+: only the owned, reduced slice.
        self.grad_full = (torch.zeros(layout.padded, dtype=policy.grad_dtype or layout.dtype, device=device)
                          if policy.keep_full_grads else None)
        # a buffer wider than the parameters (fp32 accumulation of bf16 gradients) cannot be their .grad: each
        # backward's .grad is added into it and dropped (GradReducer._rebind_full_grads)
        self.grad_unbound = self.grad_full is not None and self.grad_full.dtype != layout.dtype
        self.grad_shard = (None if policy.keep_full_grads or not policy.trains  # frozen: never a gradient
                           else torch.zeros(self.hi - self.lo, dtype=layout.dtype, device=device))
        self.has_grad = False  # the owned slice holds a gradient of this optimizer step
        self.grad_released = False  # grad_shard's memory given back after offload landed it (release_grad)
        # where the owned range's reduced gradient is, chosen once: a slice of the full buffer or the shard
        self.owned_grad_tensor = self.grad_full[self.lo:self.hi] if self.grad_full is not None else self.grad_shard
        # Offload (zerocore.offload) hands the group one ``GroupOffload`` (attach_offload); its
        # readiness and on-gather action are copied into plain attributes there, read per gather.
        self.offload: GroupOffload | None = None
        self._ready = None
        self._on_gather = None
        self.params_on_host = False  # stage-3 parameter offload: param_shard rests in host memory
        self._staged = None  # the device copy of a host-resident shard while its all-gather runs
        self._defer_gather = False  # the next gather is deferred (defer_next_gather)
        self.grad_views: list[torch.Tensor] = []  # stages 0/1: each parameter's view of grad_full, made once
        self.full_bytes = layout.padded * param_flat.element_size()  # a plain attribute: read per gather
        self._storage = param_flat.untyped_storage()  # made once: resized on every gather and free
        # Stage 3: what each parameter shows while gathered (its view of param_flat, made by
        # bind_params) and while freed (the empty tensor); set in one native call each way.
        self._empties = [self._empty] * len(params)
        self._set_data = param_ops().set_data
        self.grad_offsets = [slot.offset for slot in layout.slots]  # where each .grad packs in a bucket
        if self.partitioned:  # an engine dropped without destroy(): its parameters hold nothing any more
            weakref.finalize(self, _mark_lost, [(weakref.ref(p), s.numel) for p, s in zip(params, layout.slots)])
        # How a gather is issued, chosen once (again when offload attaches): resident or offloaded. The
        # class's function, not a bound method: a bound method kept on the group would be a cycle.
        self._issue = ShardedGroup._issue_resident if self.partitioned else ShardedGroup._issue_gather

    @property
    def index(self) -> int:
        return self.layout.index

    def owned_params(self) -> torch.Tensor:
        """The owned range of the parameters, holding every update stepped so far."""
        if self._ready is not None:
            self._ready.wait()
        return self.param_shard if self.partitioned else self.param_flat[self.lo:self.hi]

    def owned_params_raw(self) -> torch.Tensor:
        """The owned range as it is now (the offload worker writes into it)."""
        return self.param_shard if self.partitioned else self.param_flat[self.lo:self.hi]

    def offload_params(self, pin: bool) -> None:
        """Stage-3 parameter offload: the owned shard moves to host memory (page-locked when ``pin``)."""
        assert self.partitioned
        from ..offload.host_memory import host_empty  # (page-locked buffers sized to the page)

        host = host_empty(self.param_shard.numel(), self.param_shard.dtype, pin)
        host.copy_(self.param_shard)
        self.param_shard = host
        self.params_on_host = True
        self._issue = ShardedGroup._issue_gather

    def attach_offload(self, offload: GroupOffload) -> None:
        """Offload's hold on this group, handed over once: reads and gathers wait for
        ``offload.ready``; ``offload.on_gather(index)`` is told of every gather."""
        if self.offload is not None:
            raise RuntimeError(f"group {self.layout.index} already has its offload attached")
        self.offload = offload
        self._ready, self._on_gather = offload.ready, offload.on_gather
        self._issue = ShardedGroup._issue_gather

    def defer_next_gather(self) -> None:
        """The next prefetching gather of this group is issued only when the unit is waited for:
        asked by offload after it queues the group's host step (the host step runs while earlier
        units compute, and a prefetch must not block on it)."""
        assert self.offload is not None and self.offload.queued, "only a group whose host steps are queued"
        self._defer_gather = True

    # -- stage 3: gather / free ------------------------------------------------------------
    # The hot path of stage 3 (twice per unit per step). Every state change goes through the
    # state table (``Tracked.to``); the parameters are shown or hidden with one native call
    # (``ops.params.set_data``), never a Python loop per parameter.
    def start_gather(self, comm, async_op: bool = True):
        """Allocates the full buffer and starts the all-gather of every rank's chunk into it.
        Offloaded: first waits for this group's host step (only this group's), and copies a
        host-resident shard to the device (on the stream the all-gather follows). A collective
        that completed at once (a world of one) leaves the group GATHERED and returns ``DONE``."""
        if self._on_gather is not None:
            self._on_gather(self.layout.index)
        self.param_state.to(ParamState.GATHERING)
        st = self._storage
        if st.nbytes() != self.full_bytes:
            st.resize_(self.full_bytes)
        if self._defer_gather and async_op:
            # A prefetch right after an offloaded step must not block on this group's host step
            # (which runs while earlier units compute): the all-gather is issued when the unit is
            # waited for. Decided by this flag, never by timing, so every rank issues its
            # collectives in the same order.
            self._defer_gather = False
            return _DeferredGather(self, comm)
        handle = self._issue(self, comm, async_op)
        if handle is DONE:  # landed already (a world of one)
            self.finish_gather()
        return handle

    def _issue_resident(self, comm, async_op: bool):
        """``_issue`` of a group whose owned chunk is on the device with no host step to wait for."""
        return comm.all_gather_into(self.param_flat, self.param_shard, async_op=async_op)

    def _issue_gather(self, comm, async_op: bool):
        """``_issue`` of an offloaded group: waits for its host step, stages a host-resident chunk."""
        mine = self.owned_params()
        if mine.device != self.param_flat.device:  # a host-resident shard: to the device first
            self._staged = mine.to(self.param_flat.device, non_blocking=True)
            mine = self._staged
        return comm.all_gather_into(self.param_flat, mine, async_op=async_op)

    def finish_gather(self) -> None:
        """The all-gather has landed: the parameters show their full values (idempotent). The one
        place a gather ends, whichever way it was issued."""
        ps = self.param_state
        if ps.value is ParamState.GATHERED:
            return
        ps.to(ParamState.GATHERED)
        self._staged = None  # the device copy of a host-resident shard is done with
        self._set_data(self.params, self._views)

    def free_full(self) -> None:
        """Back to the owned chunk only: the full buffer's bytes are released and every parameter
        is the empty tensor (a stray read fails on the shape, and the access hook sees it)."""
        self.param_state.to(ParamState.SHARDED)
        self._set_data(self.params, self._empties)
        self._storage.resize_(0)

    def free_full_keeping_aliases(self) -> None:
        """``free_full`` for a gather outside the training passes (``zerocore.gathered``): the group
        takes a new, empty, full buffer instead of resizing the one it gathered into, so a tensor the
        user took from a gathered parameter (``p.detach()``, a state dict) keeps its values after
        the context; its bytes go when the last such reference does. Not on the hot path: it makes
        the group's views again."""
        self.param_state.to(ParamState.SHARDED)
        self._set_data(self.params, self._empties)
        flat = torch.empty(self.layout.padded, dtype=self.layout.dtype, device=self.param_flat.device)
        self._views = [flat[slot.offset:slot.end].view(slot.shape) for slot in self.layout.slots]  # (needs the bytes)
        flat.untyped_storage().resize_(0)
        self.param_flat, self._storage = flat, flat.untyped_storage()

    def release_grad(self) -> None:
        """Stages 2/3 with the optimizer step on the host: once this boundary's reduced gradient has
        landed in host memory nothing reads ``grad_shard`` on the device any more, so its memory goes
        back to the allocator until the next window's first reduction writes it again (``reacquire_grad``)
        (DeepSpeed's stage 2 with offload keeps no device gradient partition either: 2 bytes per
        parameter over the ranks, 0.63 GiB of a 337M model at one rank). The caller has queued every
        use of it (the copy to the host on its side stream is recorded there, so the allocator reuses
        the block only after it)."""
        assert self.grad_full is None and self.grad_shard is not None, "only a gradient shard of its own"
        self.grad_shard.untyped_storage().resize_(0)
        self.grad_released = True

    def reacquire_grad(self) -> None:
        """Memory for ``grad_shard`` again, before the reducer writes it. Usually the window's first
        reduction, which overwrites it; where the gradient is still held (the step after the boundary
        failed or was not called, and this backward adds to it) its values come back from the copy that
        landed in host memory (bit for bit: the host Adam only reads it)."""
        t = self.grad_shard
        t.untyped_storage().resize_(t.numel() * t.element_size())
        self.grad_released = False
        if self.has_grad:
            t.copy_(self.offload.shard.landed_copy(), non_blocking=True)

    def owned_grad(self) -> torch.Tensor:
        """The reduced gradient of the owned range (valid in state HELD)."""
        self.grad_state.expect(GradState.HELD)
        return self.owned_grad_tensor

    def bind_params(self) -> None:
        """Makes every parameter a view of its slot in ``param_flat``."""
        self._views = [self.param_flat[slot.offset:slot.end].view(slot.shape) for slot in self.layout.slots]
        self._set_data(self.params, self._views)

    def grad_view(self, i: int) -> torch.Tensor:
        slot = self.layout.slots[i]
        return self.grad_full[slot.offset:slot.end].view(slot.shape)

    def bind_grads(self) -> None:
        """Stages 0/1: every parameter's ``.grad`` is a view of its slot in ``grad_full`` (None where the buffer
        is wider than the parameters: ``grad_unbound``)."""
        if self.grad_full is None:
            return
        if not self.grad_views:  # the same view objects every step: the reducer tests ``p.grad is view``
            self.grad_views = [self.grad_view(i) for i in range(len(self.params))]
        for p, v in zip(self.params, self.grad_views):
            p.grad = None if self.grad_unbound else v

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The tensors this group holds, by role (for memory accounting)."""
        grads = self.grad_full if self.grad_full is not None else self.grad_shard
        if self.partitioned:  # the full buffer counts only while gathered (its storage is resized)
            kind = "params" if self.policy.trains else "frozen"
            shard_role = f"host_{kind}" if self.params_on_host else kind
            return {shard_role: self.param_shard, "gathered": self.param_flat, "grads": grads, "staged": self._staged}
        return {"params": self.param_flat, "grads": grads}


def _mark_lost(params: list) -> None:
    """A stage-3 group was freed: its parameters that are still the empty stand-in (not given back by
    ``destroy()``, whole or as chunks in ``_zc_init``) are marked as having lost their values."""
    for ref, numel in params:
        p = ref()
        if p is not None and numel > 0 and p.numel() == 0 and "_zc_init" not in p.__dict__:
            setattr(p, LOST_VALUES, True)


class _DeferredGather:
    """The all-gather of a group whose host step may still be running: issued at ``wait()``."""

    def __init__(self, group: ShardedGroup, comm):
        self.group, self.comm = group, comm
        self.done = False

    def wait(self) -> None:
        if not self.done:
            self.done = True
            self.group._issue_gather(self.comm, async_op=False)


_CLEARABLE = (GradState.EMPTY, GradState.FILLING, GradState.HELD)
_GRAD = attrgetter("grad")


def clear_grads_of(groups: list[ShardedGroup]) -> None:
    """Forgets the gradients of this optimizer step of many groups, with no Python call per group
    (the reducer clears every group after every step; at stage 3 that is one group per unit)."""
    expect_all([g.grad_state for g in groups], *_CLEARABLE)  # before anything is cleared
    for g in groups:
        if g.grad_full is not None:
            g.grad_full.zero_()
            g.bind_grads()
        elif any(map(is_not, map(_GRAD, g.params), repeat(None))):  # usually none: the reducer dropped them
            for p in g.params:
                p.grad = None
        g.has_grad = False
    move_all([g.grad_state for g in groups], GradState.EMPTY)
