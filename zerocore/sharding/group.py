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

import torch

from .policy import StagePolicy
from .records import FlatGroup
from .state import GradState, ParamState, grad_state, param_state


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
        self.grad_full = (torch.zeros(layout.padded, dtype=layout.dtype, device=device)
                          if policy.keep_full_grads else None)
        self.grad_shard = (None if policy.keep_full_grads
                           else torch.zeros(self.hi - self.lo, dtype=layout.dtype, device=device))
        self.has_grad = False  # the owned slice holds a gradient of this optimizer step
        self.grad_views: list[torch.Tensor] = []  # stages 0/1: each parameter's view of grad_full, made once

    @property
    def index(self) -> int:
        return self.layout.index

    def owned_params(self) -> torch.Tensor:
        return self.param_shard if self.partitioned else self.param_flat[self.lo:self.hi]

    @property
    def full_bytes(self) -> int:
        return self.layout.padded * self.param_flat.element_size()

    # -- stage 3: gather / free ------------------------------------------------------------
    def start_gather(self, comm, async_op: bool = True):
        """Allocates the full buffer and starts the all-gather of every rank's chunk into it."""
        self.param_state.to(ParamState.GATHERING)
        st = self.param_flat.untyped_storage()
        if st.nbytes() != self.full_bytes:
            st.resize_(self.full_bytes)
        return comm.all_gather_into(self.param_flat, self.param_shard, async_op=async_op)

    def finish_gather(self) -> None:
        """The all-gather has landed: the parameters show their full values."""
        self.param_state.to(ParamState.GATHERED)
        for p, v in zip(self.params, self._views):
            p.data = v

    def free_full(self) -> None:
        """Back to the owned chunk only: the full buffer's bytes are released."""
        self.param_state.to(ParamState.SHARDED)
        for p in self.params:
            p.data = self._empty
        self.param_flat.untyped_storage().resize_(0)

    def owned_grad(self) -> torch.Tensor:
        """The reduced gradient of the owned range (valid in state HELD)."""
        self.grad_state.expect(GradState.HELD)
        return self.grad_full[self.lo:self.hi] if self.grad_full is not None else self.grad_shard

    def bind_params(self) -> None:
        """Makes every parameter a view of its slot in ``param_flat``."""
        self._views = [self.param_flat[slot.offset:slot.end].view(slot.shape) for slot in self.layout.slots]
        for p, v in zip(self.params, self._views):
            p.data = v

    def grad_view(self, i: int) -> torch.Tensor:
        slot = self.layout.slots[i]
        return self.grad_full[slot.offset:slot.end].view(slot.shape)

    def bind_grads(self) -> None:
        """Stages 0/1: every parameter's ``.grad`` is a view of its slot in ``grad_full``."""
        if self.grad_full is not None:
            if not self.grad_views:  # the same view objects every step: the reducer tests ``p.grad is view``
                self.grad_views = [self.grad_view(i) for i in range(len(self.params))]
            for p, v in zip(self.params, self.grad_views):
                p.grad = v

    def clear_grads(self) -> None:
        """Forgets this step's gradients (after the optimizer step, or zero_grad)."""
        self.grad_state.expect(GradState.EMPTY, GradState.FILLING, GradState.HELD)
        if self.grad_full is not None:
            self.grad_full.zero_()
            self.bind_grads()
        else:
            for p in self.params:
                p.grad = None
        self.has_grad = False
        self.grad_state.to(GradState.EMPTY)

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The tensors this group holds, by role (for memory accounting)."""
        grads = self.grad_full if self.grad_full is not None else self.grad_shard
        if self.partitioned:  # the full buffer counts only while gathered (its storage is resized)
            return {"params": self.param_shard, "gathered": self.param_flat, "grads": grads}
        return {"params": self.param_flat, "grads": grads}
