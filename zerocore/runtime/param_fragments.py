"""One parameter's fp32 master, Adam moments and reduced gradient, read and written through the engine's
flat groups: whole (``full``: a collective, every rank gets the parameter's full shape) or this rank's piece
(``local``: the part of the parameter inside this rank's owned range of its flat group, flattened; empty where
the rank owns none of it). What DeepSpeed's ``deepspeed.utils.safe_get_full_fp32_param`` and its siblings do
(``zerocore.deepspeed.utils.tensor_fragment`` are those functions over this module).

Where the values are: a parameter is a slot [offset, end) of its group's flat buffer, and each rank owns the
group's range [lo, hi) (stage 0: everything); the optimizer state of that range streams through
``OptimizerShard.state_tiles`` whatever holds it (device, host memory, NVMe swap files), which also waits for a
host step still running on the offload worker, and with ``write=True`` keeps what is written (a speculative
host step under way is dropped, as for a checkpoint load). The reduced gradient is the owned slice the last
backward at an accumulation boundary left (state HELD; with optimizer offload, the copy that landed in host
memory once the device's was released; at stages 0 and 1 the whole buffer every ``.grad`` is a view of), read
as the gradient the step applies before clipping: the held sum over the ranks divided by the world size (and
under fp16 by the loss scale), as DeepSpeed's and DDP's averaged gradients read; at stages 0/1 a window not
reduced yet (``no_sync()``) reads as this rank's own gradient.

Written values go to the state the next step reads: the master (not the 16-bit parameter, which the step
derives from it, as DeepSpeed's), a moment, or the gradient. Everything returned is fp32 on the engine's device
(DeepSpeed's), a copy: editing it changes nothing until it is written back."""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..comm.divergence import Op
from ..sharding import GradState
from .checkpoint_marks import mark_written
from .gathered import owner_and_slot

KINDS = ("fp32", "exp_avg", "exp_avg_sq", "grad")
_TILE_KEY = {"fp32": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


@dataclasses.dataclass
class Fragment:
    """Where one trainable parameter's elements are: its group, the group's optimizer shard, its slot in the
    flat buffer, and the flat range [x, y) of it this rank owns (x == y: none)."""

    engine: object
    group: object
    shard: object
    offset: int
    numel: int
    shape: torch.Size
    x: int
    y: int

    @property
    def local_numel(self) -> int:
        return self.y - self.x


def locate(param) -> Fragment | None:
    """The fragment of ``param`` in the live engine holding it; None for a parameter no engine trains (frozen,
    or in no engine: DeepSpeed's functions return None there too)."""
    engine, hit = owner_and_slot(param)
    if engine is None:
        return None
    index, i = hit
    if index >= len(engine.groups) or engine.groups[index].index != index:  # a frozen group: no master, no state
        return None
    g = engine.groups[index]
    slot = g.layout.slots[i]
    x, y = max(slot.offset, g.lo), min(slot.end, g.hi)
    return Fragment(engine, g, engine.shards[index], slot.offset, slot.numel, slot.shape, x, max(x, y))


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"zerocore: optimizer state key {kind!r} is not one of zerocore's Adam states "
                         f"('exp_avg', 'exp_avg_sq'; 'fp32' for the master, 'grad' for the gradient)")


def _state_piece(f: Fragment, kind: str, write: torch.Tensor | None = None) -> torch.Tensor | None:
    """This rank's piece of the master or a moment (fp32, a copy); with ``write``, those elements replaced."""
    a, b = f.x - f.group.lo, f.y - f.group.lo  # owned-range coordinates
    out = None if write is not None else torch.empty(b - a, dtype=torch.float32, device=f.engine.device)
    if a == b:
        return out
    key = _TILE_KEY[kind]
    for lo, hi, tile in f.shard.state_tiles(1 << 62, write=write is not None):
        s, e = max(lo, a), min(hi, b)
        if s >= e:
            continue
        if write is None:
            out[s - a:e - a].copy_(tile[key][s - lo:e - lo])
        else:
            tile[key][s - lo:e - lo].copy_(write[s - a:e - a])
    return out


def _owned_grad(f: Fragment) -> tuple[torch.Tensor, float]:
    """(the owned range's held gradient, what to divide it by for the gradient the step applies). Stages 2/3:
    only once reduced at a boundary (HELD). Stages 0/1 (the whole buffer is here): also a window's gradients
    not reduced yet (inside ``no_sync()``, or before the boundary), this rank's own, unscaled but not averaged
    over the ranks, as ``.grad`` reads in DeepSpeed there."""
    g, e = f.group, f.engine
    state = g.grad_state.value
    if g.grad_full is not None and state in (GradState.EMPTY, GradState.FILLING):
        return g.owned_grad_tensor, float(e.scaler.scale)
    if state is not GradState.HELD:
        raise RuntimeError(f"zerocore: the gradient of group {g.index} is not held now (state {state.value}): read "
                           "or write gradients after engine.backward() at an accumulation boundary and before "
                           "engine.step()")
    divisor = e.comm.world * float(e.scaler.scale)  # the reductions sum over the ranks; fp16 carries the loss scale
    if g.grad_released:  # optimizer offload gave the device's copy back once it landed in host memory
        return g.offload.shard.landed_copy(), divisor
    return g.owned_grad(), divisor


def _grad_piece(f: Fragment) -> torch.Tensor:
    """This rank's piece of the gradient the step applies (before clipping): the mean over ranks and
    micro-batches, unscaled."""
    a, b = f.x - f.group.lo, f.y - f.group.lo
    owned, divisor = _owned_grad(f)
    return owned[a:b].to(f.engine.device, torch.float32, copy=True) / divisor


def _write_grad(f: Fragment, values: torch.Tensor, whole: bool) -> None:
    """The held gradient set so that the step applies ``values``: this rank's piece, or (``whole``, stages 0/1)
    the parameter's whole slot of the full buffer. With optimizer offload the gradient landed already (its host
    copy, its norm): the device's copy takes the values (given back by ``release_grad`` after landing: taken
    again first) and the group lands again (``OffloadPlan.land``)."""
    g, offload = f.group, f.engine.offload
    _, divisor = _owned_grad(f)  # (its state checked)
    landed = offload is not None and g.grad_state.value is GradState.HELD
    if landed and g.grad_released:
        g.reacquire_grad()
    if whole:
        g.grad_full[f.offset:f.offset + f.numel].copy_(values * divisor)
    else:
        g.owned_grad_tensor[f.x - g.lo:f.y - g.lo].copy_(values * divisor)
    if landed:
        if _relanding is not None:
            _relanding[(id(f.engine), g.index)] = (offload, g.index)
        else:
            offload.land(g.index)


# (engine id, group index) -> (its OffloadPlan, the index): groups written inside ``landing_once()``, landed at its end
_relanding: dict | None = None


@contextlib.contextmanager
def landing_once():
    """Gradient writes inside land each offloaded group they touched once, at the end, not once per write (a
    group's landing copies its whole owned gradient: ``safe_update_full_grad_vectorized`` writes every
    parameter of it)."""
    global _relanding
    outer, _relanding = _relanding, {}
    try:
        yield
    finally:
        touched, _relanding = _relanding, outer
        for offload, k in touched.values():
            offload.land(k)


def local(param, kind: str) -> torch.Tensor | None:
    """This rank's piece of ``param``'s master / moment / reduced gradient (``kind``), fp32, flat."""
    _check_kind(kind)
    f = locate(param)
    if f is None:
        return None
    return _grad_piece(f) if kind == "grad" else _state_piece(f, kind)


def set_local(param, value: torch.Tensor, kind: str) -> None:
    """Writes this rank's piece (``value``: as many elements as ``local`` returns)."""
    _check_kind(kind)
    f = locate(param)
    if f is None:
        return
    value = torch.as_tensor(value).reshape(-1)
    if value.numel() != f.local_numel:
        raise ValueError(f"zerocore: this rank holds {f.local_numel} elements of the parameter (of {f.numel}); the "
                         f"value has {value.numel()}")
    _write(f, kind, value.to(torch.float32))


def full(param, kind: str) -> torch.Tensor | None:
    """``param``'s whole master / moment / reduced gradient, fp32, in its shape, on every rank. A collective:
    every rank calls it for the same parameter."""
    _check_kind(kind)
    f = locate(param)
    if f is None:
        return None
    if kind == "grad" and f.engine._coalescing:  # inside coalesce_grad_reduction(): this rank's own sum so far,
        return param.grad                       # unreduced, as DeepSpeed documents it (no collective)
    if kind == "grad" and f.group.grad_full is not None:  # stages 0/1: every rank holds the whole gradient
        _, divisor = _owned_grad(f)  # (its state checked)
        whole = f.group.grad_full[f.offset:f.offset + f.numel].to(torch.float32, copy=True)
        return (whole / divisor).view(f.shape)
    whole = torch.zeros(f.numel, dtype=torch.float32, device=f.engine.device)
    piece = _grad_piece(f) if kind == "grad" else _state_piece(f, kind)
    whole[f.x - f.offset:f.y - f.offset].copy_(piece)
    if _sharded(f, kind):  # each rank contributes its own piece, zeros elsewhere
        f.engine.guard.check(Op.CONTEXT, f.group.index, 0)
        f.engine.comm.all_reduce(whole)
    return whole.view(f.shape)


def set_full(param, value: torch.Tensor, kind: str) -> None:
    """Writes ``param``'s whole master / moment / gradient from ``value`` (its number of elements): each rank
    keeps the piece it owns (no communication; every rank should pass the same value)."""
    _check_kind(kind)
    f = locate(param)
    if f is None:
        return
    value = torch.as_tensor(value)
    if value.numel() != f.numel:
        raise ValueError(f"zerocore: the parameter has {f.numel} elements; the value has {value.numel()}")
    flat = value.reshape(-1).to(torch.float32)
    if kind == "grad" and f.group.grad_full is not None:  # stages 0/1: the whole gradient is here
        _write_grad(f, flat, whole=True)
        return
    _write(f, kind, flat[f.x - f.offset:f.y - f.offset])


def _write(f: Fragment, kind: str, piece: torch.Tensor) -> None:
    if kind == "grad":
        _write_grad(f, piece, whole=False)
    else:
        _state_piece(f, kind, write=piece)
        mark_written(f.engine)


def _sharded(f: Fragment, kind: str) -> bool:
    """Whether another rank holds part of the parameter's values of this kind: the optimizer state from stage 1
    on, the reduced gradient from stage 2 on (at stages 0/1 the gradient is whole on every rank)."""
    if f.engine.comm.world == 1:
        return False
    return kind == "grad" or bool(f.engine.policy.shard_optimizer)  # (grad: stages 0/1 returned before)
