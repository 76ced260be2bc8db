"""DeepSpeed's stage-3 parameter attributes, which third-party code reads (``hasattr(p, "ds_id")``
to tell a partitioned parameter, ``p.ds_numel`` for its size, ``p.ds_status`` before gathering):

- ``ds_id``: a number unique in the process, in the order parameters were partitioned;
- ``ds_numel``, ``ds_shape``: the full parameter's element count and shape (``p.shape`` is
  ``(0,)`` while it rests partitioned);
- ``ds_tensor``: the part of the parameter this rank holds, flat, in the training dtype (zerocore
  partitions each unit's flat buffer, so it is the parameter's slice of this rank's range, which
  may be empty; a parameter partitioned by ``zerocore.init`` before an engine: its chunk);
- ``ds_status``: ``ZeroParamStatus.AVAILABLE`` while the full value is there (gathered, or kept
  whole), else ``NOT_AVAILABLE`` (a gather in flight shows NOT_AVAILABLE until it lands: INFLIGHT
  is never reported);
- ``partition_numel()``: the element count of ``ds_tensor`` (Lightning's DeepSpeed summary reads it);
- ``ds_persist``: the parameter is kept whole on every rank (stage3_param_persistence_threshold,
  stage3_persistent_param_names, frozen parameters).

``ds_status`` and ``ds_tensor`` are read from the parameter when asked (properties of a subclass
the parameter's class is swapped to, as long as it is partitioned), so gathering and freeing, the
hot path, set nothing. ``detach`` gives the parameters their classes back (``destroy()``).
"""
from __future__ import annotations

import enum
import itertools
import weakref

import torch
from torch import nn


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's values (``deepspeed.runtime.zero.partition_parameters.ZeroParamStatus``)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_ids = itertools.count()
_ATTRS = ("ds_id", "ds_numel", "ds_shape", "ds_persist", "_zc_ds_range")
# parameter -> weak reference to the engine group holding it (only plain data sits on the parameter: it
# must neither keep the engine's buffers alive nor hold zerocore objects, and it stays picklable)
# (keyed by id: a tensor cannot be a WeakKeyDictionary key, its == is elementwise)
_GROUP_OF: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _forget(key: int):
    return lambda _ref: _GROUP_OF.pop(key, None)  # the parameter died: its entry goes


def _group_of(p):
    entry = _GROUP_OF.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def _part(p) -> torch.Tensor:
    """``ds_tensor``: the range [a, b) of the group's flat buffer that this rank owns and that holds
    ``p``; a parameter kept whole outside the groups: all of it; one partitioned by zerocore.init
    before an engine: its chunk."""
    rec = p.__dict__.get("_zc_init")
    if rec is not None:
        return rec.chunk
    rng = p.__dict__.get("_zc_ds_range")
    if rng is None:
        return p.detach().reshape(-1)
    g = _group_of(p)
    if g is None:  # the engine is gone
        return torch.empty(0, dtype=p.dtype, device=p.device)
    return g.owned_params()[rng[0] - g.lo:rng[1] - g.lo]


def is_partitioned_now(p: nn.Parameter) -> bool:
    """``p`` is a stage-3 (or ``zerocore.init``) parameter that is the empty stand-in now: it holds none of its
    ``ds_numel`` values (outside its unit's forward and ``zerocore.gathered``)."""
    whole = p.__dict__.get("ds_numel")
    return whole is not None and whole > 0 and p.numel() == 0


class _Props:
    @property
    def ds_status(self) -> ZeroParamStatus:
        return ZeroParamStatus.AVAILABLE if self.numel() == self.ds_numel else ZeroParamStatus.NOT_AVAILABLE

    @property
    def ds_tensor(self) -> torch.Tensor:
        return _part(self)

    def partition_numel(self) -> int:
        """DeepSpeed's method: the element count of this rank's part (``ds_tensor``)."""
        return _part(self).numel()

    def __deepcopy__(self, memo):
        # a partitioned parameter is the empty tensor: its copy would hold nothing, silently (DeepSpeed's
        # copies are empty so). Refused, naming the way to copy it whole.
        if is_partitioned_now(self):
            from .gathered import describe

            raise RuntimeError(
                f"zerocore: copy.deepcopy of stage-3 parameter {describe(self)} while it is "
                "partitioned (this rank holds a chunk; the parameter is the empty tensor outside its module's "
                "forward): the copy would hold nothing. Copy it gathered: `with zerocore.gathered(list("
                "module.parameters())): copy.deepcopy(module)` (a collective), or take the full weights with "
                "engine.full_state_dict()")
        # torch copies data and requires_grad only (as for DeepSpeed's parameters): a plain parameter
        result = super().__deepcopy__(memo)
        result.__class__ = type(self)._zc_ds_original
        return result


_SUBCLASSES: dict[type, type] = {}


def _swapped_class(cls: type) -> type:
    if getattr(cls, "_zc_ds_original", None) is not None:
        return cls
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (_Props, cls), {"_zc_ds_original": cls, "__module__": cls.__module__})
        _SUBCLASSES[cls] = sub
    return sub


def mark(p: nn.Parameter, shape: torch.Size, persist: bool, group=None, a: int = 0, b: int = 0) -> None:
    """Gives ``p`` the attributes (a parameter marked before keeps its ds_id); ``group``: the engine
    group holding it, ``[a, b)`` its part of the group's owned range."""
    if "ds_id" not in p.__dict__:
        p.ds_id = next(_ids)
    p.ds_numel = shape.numel()
    p.ds_shape = shape
    p.ds_persist = persist
    if group is not None:
        p._zc_ds_range = (a, b)
        _GROUP_OF[id(p)] = (weakref.ref(p, _forget(id(p))), weakref.ref(group))
    p.__class__ = _swapped_class(type(p))


def mark_init(p: nn.Parameter) -> None:
    """A parameter ``zerocore.init`` just partitioned (its chunk is in ``p._zc_init``)."""
    mark(p, p._zc_init.shape, persist=False)


def attach(engine) -> None:
    """Every parameter of a stage-3 engine: those of its groups (partitioned units, their frozen
    groups, and the whole persistent groups) and the ones it keeps whole outside them (small frozen
    ones, those in no hyper group)."""
    grouped = set()
    for g in list(engine.groups) + list(getattr(engine, "frozen_groups", [])):
        for p, s in zip(g.params, g.layout.slots):
            a = max(s.offset, g.lo)
            mark(p, s.shape, not g.partitioned, g, a, max(a, min(s.end, g.hi)))
            grouped.add(id(p))
    for p in engine.module.parameters():
        if id(p) not in grouped:
            mark(p, p.shape, persist=True)


def detach(params) -> None:
    """The attributes removed and each parameter's own class back."""
    for p in params:
        original = getattr(type(p), "_zc_ds_original", None)
        if original is None:
            continue
        p.__class__ = original
        for name in _ATTRS:
            p.__dict__.pop(name, None)
        _GROUP_OF.pop(id(p), None)
