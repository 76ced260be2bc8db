"""A client ``torch.optim.Optimizer`` other than Adam, stepped on each rank's flat fp32 shards.

A new instance of the user's optimizer class is built over the owned fp32 master shards, one
tensor per (flat group, hyper-parameter group) piece, in param groups that mirror the user's
(same options); at each update the reduced gradient pieces (times the engine's unscale/clip
coefficient) become those tensors' ``.grad``, the optimizer's own ``step()`` runs, and the
16-bit parameters are cast from the new master. Its state is therefore sharded exactly like
Adam's: every state tensor shaped like its piece (SGD's momentum_buffer, Adagrad's sum) is
saved in checkpoints as a per-parameter kind beside the master, reshardable to any world size;
scalar state (``step``) is the same in every piece of a group and saved once per group.

Device shards step in the engine's batches (``TorchBatch``, one optimizer ``step()`` per batch:
torch optimizers skip tensors whose ``.grad`` is None); host (CPU offload) shards step inside
their own host step (``host_kernel``), on the offload worker at stage 3.
"""
from __future__ import annotations

import copy
import weakref

import torch

from .. import ops
from .._weak import GONE, EngineGone
from ..offload.host_shard import HostOptimizerShard


def _rebuild(client: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """An instance of ``client``'s class over ``groups`` (each with every option key)."""
    cls = type(client)
    try:
        inner = cls(groups)
    except TypeError:  # a constructor with required arguments: copy the instance, then reset it
        inner = copy.copy(client)
        torch.optim.Optimizer.__init__(inner, groups, client.defaults)
    inner.defaults = dict(client.defaults)
    return inner


class TorchShardStep:
    def __init__(self, client: torch.optim.Optimizer, shards, face_groups: list[dict]):
        self.client_name = type(client).__name__
        self.shards = shards
        self.views: list[list[tuple[int, int, int, torch.Tensor]]] = []
        groups = [{**{k: v for k, v in g.items() if k not in ("params", "initial_lr")}, "params": []}
                  for g in face_groups]
        for shard in shards:
            master = self._master(shard)
            vs = []
            for a, b, h in shard.pieces:
                v = master[a:b]
                groups[h]["params"].append(v)
                vs.append((a, b, h, v))
            self.views.append(vs)
        self.inner = _rebuild(client, groups)
        self.load_kinds: list[str] = []
        for k, shard in enumerate(shards):
            # the Adam moments are not this optimizer's state
            if isinstance(shard, HostOptimizerShard):
                shard.exp_avg_h = shard.exp_avg_sq_h = torch.empty(0)
                shard.kernel = self.host_kernel(k)
            else:
                shard.exp_avg = shard.exp_avg_sq = torch.empty(0, device=shard.master.device)
            shard.state_tiles = self._tiles_of(k)

    @staticmethod
    def _master(shard) -> torch.Tensor:
        return shard.master_h if isinstance(shard, HostOptimizerShard) else shard.master

    def sync(self, face_groups: list[dict]) -> None:
        """The face's current group values (a schedule's lr, a user's edit) into the inner optimizer."""
        for src, dst in zip(face_groups, self.inner.param_groups):
            for key, value in src.items():
                if key != "params" and key in dst:
                    dst[key] = value

    def _set_grads(self, k: int, grad: torch.Tensor, coef: float) -> None:
        for a, b, _, v in self.views[k]:
            g = grad[a:b]
            g = g.float() * coef if g.dtype != torch.float32 or g.device != v.device else g.mul_(coef)
            v.grad = g.to(v.device) if g.device != v.device else g

    def _clear(self, k: int) -> None:
        for _, _, _, v in self.views[k]:
            v.grad = None

    def step_device(self, index: list[int], grads: list[torch.Tensor], coef: float) -> None:
        """Device-resident shards ``index`` (engine group indices) in one optimizer step."""
        for k in index:
            self._set_grads(k, grads[k], coef)
        try:
            self.inner.step()
        finally:
            for k in index:
                self._clear(k)
        for k in index:
            shard = self.shards[k]
            if shard.param_out is not None:
                ops.cast(shard.master, shard.param_out)

    # The two functions below are handed to the shards this object holds: they reach it weakly (a
    # closure over ``self`` kept by a shard would be a cycle, freed only by the cyclic collector).
    def host_kernel(self, k: int):
        me = weakref.ref(self)

        def kernel(master, grad, out, grad_scale):
            self = _alive(me)
            self._set_grads(k, grad, grad_scale)
            try:
                self.inner.step()
            finally:
                self._clear(k)
            if out is not None:
                out.copy_(master)
        return kernel

    # -- checkpoints ---------------------------------------------------------------------------
    def kinds(self) -> list[str]:
        """Names of the state tensors shaped like their piece (sorted), over every piece."""
        found = set()
        for vs in self.views:
            for _, _, _, v in vs:
                for key, t in self.inner.state.get(v, {}).items():
                    if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape == v.shape:
                        found.add(key)
        return sorted(found)

    def scalars(self) -> dict[int, dict]:
        """Per hyper group: the state that is not shaped like a piece (``step``), from its first piece."""
        out: dict[int, dict] = {}
        for vs in self.views:
            for _, _, h, v in vs:
                if h in out or v not in self.inner.state:
                    continue
                out[h] = {key: (t.clone() if isinstance(t, torch.Tensor) else t)
                          for key, t in self.inner.state[v].items()
                          if not (isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape == v.shape)}
        return out

    def restore_scalars(self, saved: dict[int, dict]) -> None:
        for vs in self.views:
            for _, _, h, v in vs:
                for key, t in saved.get(h, {}).items():
                    self.inner.state[v][key] = t.clone().to(v.device) if isinstance(t, torch.Tensor) else t

    def _tiles_of(self, k: int):
        me = weakref.ref(self)

        def state_tiles(max_elems: int, *, write: bool = False):
            self = _alive(me)
            shard = self.shards[k]
            master = self._master(shard)
            if isinstance(shard, HostOptimizerShard):
                shard.ready.wait()
            n = master.numel()
            full = {"master": master}
            for kind in (self.load_kinds if write else self.kinds()):
                if write:
                    full[kind] = torch.zeros(n, dtype=torch.float32, device=master.device)
                    continue
                parts = []
                for a, b, _, v in self.views[k]:
                    t = self.inner.state.get(v, {}).get(kind)
                    parts.append(t.detach().reshape(-1).float() if t is not None
                                 else torch.zeros(b - a, device=master.device))
                full[kind] = torch.cat(parts) if parts else torch.zeros(0)
            for a in range(0, n, max(1, max_elems)):
                b = min(n, a + max_elems)
                yield a, b, {key: t[a:b] for key, t in full.items()}
            if write:  # what the reader wrote becomes the optimizer's state
                for kind in self.load_kinds:
                    for a, b, _, v in self.views[k]:
                        self.inner.state[v][kind] = full[kind][a:b].clone().to(v.device)
        return state_tiles


def _alive(me: weakref.ref) -> "TorchShardStep":
    self = me()
    if self is None:
        raise EngineGone(GONE)
    return self


class TorchBatch:
    """MultiShardStep's place in the engine's step batches, for a client torch optimizer."""

    def __init__(self, step: TorchShardStep, index: list[int], face_groups: list[dict]):
        self.torch_step, self.index, self.face_groups = step, index, face_groups

    def step(self, grads, hp, *, step: int, grad_scale: float) -> None:
        self.torch_step.sync(self.face_groups)
        self.torch_step.step_device(self.index, grads, grad_scale)
