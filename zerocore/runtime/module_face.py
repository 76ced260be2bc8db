"""The engine as a ``torch.nn.Module`` (DeepSpeed's ``DeepSpeedEngine`` subclasses Module, and
scripts call ``engine.parameters()``, ``engine.state_dict()``, ``engine.train()`` all the time).

The wrapped model is the engine's one submodule, ``module``; nn.Module's own methods then reach
it. Three of them need the engine's say, here:

- attribute lookup: nn.Module's registries first, then, as DeepSpeed's engine does, the wrapped
  model's public attributes (``engine.linears`` is ``engine.module.linears``);
- ``to()``/``cuda()``/``half()``/...: the parameters are views into flat buffers the engine placed
  at initialize (and, for 16-bit training, rounded from an fp32 master): a call that would move
  or convert one is refused by name; one that changes nothing is allowed (buffers follow it);
- ``load_state_dict``: the values go into the training state itself (the 16-bit parameters and
  this rank's part of the fp32 master), else the next step would overwrite them from the master.
"""
from __future__ import annotations

import torch

from . import offload_states as states_aside
from .checkpoint_marks import mark_written
from .release import DESTROYED, EngineDestroyed

_PREFIX = "module."


class ModuleFace:
    """nn.Module's hooks into attribute access, moves and state loading, as the engine needs them
    (mixed into :class:`zerocore.Engine` before ``torch.nn.Module``)."""

    def __getattr__(self, name: str):
        # only reached for attributes the instance does not have: after destroy() that is all its state
        d = self.__dict__
        if d.get("_destroyed"):
            raise EngineDestroyed(f"{DESTROYED} (asked for engine.{name})")
        return _missing_attribute(self, d, name)

    def __setattr__(self, name: str, value) -> None:
        # The counters and flags backward()/step() set are plain attributes already in __dict__: set
        # directly (nn.Module's __setattr__ checks each value against its registries, microseconds a
        # set on the hot path). Anything else (the first set, modules, tensors) goes through nn.Module.
        if name in self.__dict__ and not isinstance(value, (torch.Tensor, torch.nn.Module)):
            object.__setattr__(self, name, value)
        else:
            torch.nn.Module.__setattr__(self, name, value)

    def __repr__(self) -> str:
        if self.__dict__.get("_destroyed"):
            return f"{type(self).__name__}(destroyed)"
        return torch.nn.Module.__repr__(self)

    def __dir__(self):
        if self.__dict__.get("_destroyed"):
            return object.__dir__(self)
        return torch.nn.Module.__dir__(self)

    def _apply(self, fn, recurse: bool = True):
        _refuse_moves(self, fn)
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The model's weights from ``state_dict`` (keys ``module.<name>``, as ``engine.state_dict()``
        gives them), written into the training state: the parameters, and this rank's part of the
        fp32 master (stage 3: of the partitioned chunks). Every rank passes the whole dict; no
        collective. Returns torch's ``(missing_keys, unexpected_keys)``."""
        self._alive()
        states_aside.check_resident(self, "load_state_dict()")
        return _load_state_dict(self, state_dict, strict, assign)


def _missing_attribute(engine, d: dict, name: str):
    """``engine.<name>`` not found on the instance or its class (``d``: the engine's __dict__)."""
    modules = d.get("_modules")
    if modules is not None:
        if name in modules:
            return modules[name]
        for registry in ("_parameters", "_buffers"):
            found = d[registry]
            if name in found:
                return found[name]
        module = modules.get("module")
        # the model's public attributes show through, as on DeepSpeed's engine (private names do not:
        # zerocore probes its own optional attributes with getattr defaults)
        if module is not None and not name.startswith("_"):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
    raise AttributeError(f"'{type(engine).__name__}' object has no attribute '{name}'")


def _refuse_moves(engine, fn) -> None:
    """nn.Module._apply for the engine: every parameter must come out of ``fn`` unchanged."""
    module = engine._modules["module"]
    for name, p in module.named_parameters():
        out = fn(p)
        if out is not p and (out.device != p.device or out.dtype != p.dtype or out.data_ptr() != p.data_ptr()):
            raise ValueError(
                f"zerocore: this call would move or convert parameter '{name}' ({p.dtype} on {p.device} -> "
                f"{out.dtype} on {out.device}); the engine's parameters are views into flat buffers placed (and, "
                "with bf16/fp16, rounded from an fp32 master) at initialize. Move the model before "
                "zerocore.initialize, and choose the training dtype with the config's bf16/fp16 sections")
    for m in module.modules():
        for key, buf in m._buffers.items():
            if buf is not None:
                m._buffers[key] = fn(buf)


@torch.no_grad()
def _load_state_dict(engine, state_dict, strict: bool, assign: bool):
    if assign:
        raise ValueError("zerocore: engine.load_state_dict(assign=True) would replace tensors the engine's flat "
                         "buffers hold; load with assign=False (values are copied into the training state)")
    module = engine._modules["module"]
    expected = {_PREFIX + k: t for k, t in module.state_dict(keep_vars=True).items()}
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if strict and (missing or unexpected):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(engine).__name__}: missing keys {missing}, "
                           f"unexpected keys {unexpected} (the engine's keys are the model's with the prefix "
                           f"'{_PREFIX}')")
    written = set()
    for key, target in expected.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor) or value.shape != _shape_of(engine, target):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise RuntimeError(f"zerocore: engine.load_state_dict: '{key}' is {got}, the model's is "
                               f"{tuple(_shape_of(engine, target))}")
        hit = engine.param_index.get(id(target))
        if hit is None:  # frozen parameters and buffers: whole on every rank
            target.copy_(value)
        elif id(target) not in written:  # a tied weight is written once
            _write_slot(engine, *hit, value)
            written.add(id(target))
    if written:
        mark_written(engine)  # a failed checkpoint load may no longer overwrite this state in place
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def _shape_of(engine, t: torch.Tensor) -> torch.Size:
    hit = engine.param_index.get(id(t))
    if hit is None:
        return t.shape
    return engine.groups[hit[0]].layout.slots[hit[1]].shape  # stage 3: the parameter itself may be empty


def _write_slot(engine, gi: int, si: int, value: torch.Tensor) -> None:
    """One parameter's value into group ``gi``: the 16-bit parameters this rank holds (all of them
    at stages 0-2, the owned chunk at stage 3) and the owned range of the fp32 master."""
    g, shard = engine.groups[gi], engine.shards[gi]
    s = g.layout.slots[si]
    flat = value.detach().reshape(-1).to(g.param_flat.device, torch.float32)
    if not g.partitioned or g.param_flat.untyped_storage().nbytes():  # whole here (or gathered now)
        g.param_flat[s.offset:s.end].copy_(flat)
    a, b = max(s.offset, g.lo), min(s.end, g.hi)
    if a >= b:
        return
    part = flat[a - s.offset:b - s.offset]
    if g.partitioned:
        g.owned_params()[a - g.lo:b - g.lo] = part
    if shard.master.data_ptr() != g.owned_params().data_ptr():  # a separate fp32 master
        shard.load_master(a - g.lo, b - g.lo, part)
