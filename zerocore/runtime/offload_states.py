"""``engine.offload_states()`` / ``engine.reload_states()``: the training state leaves the device for
host memory between training phases, and comes back bit for bit (DeepSpeed's methods of the same
names and meaning; RL trainers call them around generation, to give the GPU to an inference engine).

What moves, by DeepSpeed's ``OffloadStateTypeEnum`` names (``include``; all by default):

- ``optim_states``: Adam's moments (and a client torch optimizer's state tensors) held on the device;
- ``hp_params``: the fp32 master copy held on the device (with fp32 training it *is* the parameters'
  owned slice, so it moves with them);
- ``lp_params``: the training-dtype parameters: stage 0-2's flat buffers (the model's parameters are
  views of them), stage 3's owned chunks and persistent parameters, and the parameters the engine
  does not train (frozen ones: stage 3's owned chunks of them, whole ones elsewhere): DeepSpeed's
  stage 3 moves those too;
- ``lp_grads``: the gradient buffers (stages 0/1: the full buffer ``.grad`` are views of; 2/3: the
  owned reduced slice);
- ``contiguous_grad_buffer``: the reduction buckets. zerocore holds none between steps (they are
  freed at the end of every backward), so there is nothing to move.

How: each device storage is copied byte for byte into a host buffer (page-locked with
``pin_memory``) and then resized to zero bytes, so its device memory goes back to the caching
allocator while every tensor and view that uses it (parameters' ``.data``, ``.grad`` views, the
optimizer step's tensor lists) stays the same object; reload resizes it back and copies the bytes
in. Parameters whose storage moved are pointed at host views meanwhile, so the model stays readable
on the host (to send weights to an inference engine, say). Training calls (forward, backward, step,
checkpoints) refuse while states are offloaded, naming ``reload_states()``.

State already kept in host memory by the offload configuration (``offload_optimizer`` /
``offload_param``) stays where it is (DeepSpeed excludes it the same way).

On a CPU-only machine the "device" is host memory: the same moves happen (each storage's bytes go
into a fresh host buffer and the original is released), so the calls work and the round trip is
exact, but no memory is gained; there is nothing to pin. The CPU optimizer state in zerocore's own
page-aligned host memory (not resizable) stays where it is.
"""
from __future__ import annotations

import enum
import warnings
from collections.abc import Iterable

import torch

from ..offload.host_memory import should_pin


class OffloadStateType(str, enum.Enum):
    """DeepSpeed's ``OffloadStateTypeEnum``: the same names and values."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


class OffloadDevice(str, enum.Enum):
    """DeepSpeed's ``OffloadDeviceEnum``."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


OFFLOADED = ("zerocore: the engine's states are offloaded (engine.offload_states()); call engine.reload_states() "
             "before {what}")

# shard roles (OptimizerShard.tensors(), HostOptimizerShard.tensors(), ...) -> state type
_SHARD_ROLES = {"master": OffloadStateType.hp_params, "exp_avg": OffloadStateType.optim_states,
                "exp_avg_sq": OffloadStateType.optim_states}


class _Moved:
    """One device storage whose bytes wait in a host buffer."""

    __slots__ = ("storage", "device", "nbytes", "host")

    def __init__(self, storage, device: torch.device, host: torch.Tensor):
        self.storage, self.device, self.nbytes, self.host = storage, device, storage.nbytes(), host


class StatesAside:
    """What ``offload_states`` moved: the storages with their host copies, and the parameters shown
    on the host meanwhile (with what they showed before)."""

    def __init__(self):
        self.moved: list[_Moved] = []
        self.params: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # (parameter, its device .data)
        self.types: set[OffloadStateType] = set()


def parse_include(include) -> set[OffloadStateType]:
    """``include`` as DeepSpeed takes it (None: every type; enum members of zerocore's or DeepSpeed's
    enum, or their string values), checked."""
    if include is None:
        return set(OffloadStateType)
    if isinstance(include, (str, enum.Enum)):
        include = [include]
    out = set()
    for x in include:
        value = x.value if isinstance(x, enum.Enum) else x
        try:
            out.add(OffloadStateType(value))
        except ValueError:
            raise ValueError(f"zerocore: offload_states(include=...): unknown state type {x!r}; the types are "
                             f"{[t.value for t in OffloadStateType]}") from None
    return out


def _byte_view(storage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (any dtype's bytes, copied exactly)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _candidates(engine, types: set[OffloadStateType]) -> tuple[list[torch.Tensor], list[torch.nn.Parameter]]:
    """The device tensors of the selected types, and the parameters whose storage they may share."""
    device = engine.device
    tensors: list[torch.Tensor] = []

    def add(t, kind: OffloadStateType) -> None:
        if kind in types and isinstance(t, torch.Tensor) and t.device == device and t.untyped_storage().nbytes():
            tensors.append(t)

    for g in engine.groups:
        held = g.tensors()
        add(held.get("params"), OffloadStateType.lp_params)
        add(held.get("grads"), OffloadStateType.lp_grads)
    for g in engine.frozen_groups:  # stage 3: the owned chunks of frozen parameters
        add(g.tensors().get("frozen"), OffloadStateType.lp_params)
    for shard in engine.shards:
        for role, t in shard.tensors().items():
            if role in _SHARD_ROLES:  # host_* roles rest in host memory by the config: they stay
                add(t, _SHARD_ROLES[role])
    step = engine.__dict__.get("_torch_step")
    if step is not None:  # a client torch optimizer's state (momentum buffers, ...)
        for state in step.inner.state.values():
            for t in state.values():
                add(t, OffloadStateType.optim_states)
    params = [p for g in engine.groups if not g.partitioned for p in g.params]
    if OffloadStateType.lp_params in types:
        # parameters the engine does not train (frozen, or in no hyper-parameter group): whole, their own tensors
        grouped = {id(p) for g in engine.groups + engine.frozen_groups for p in g.params}
        for p in engine.module.parameters():
            if id(p) not in grouped and p.device == device and p.untyped_storage().nbytes():
                tensors.append(p.data)
                params.append(p)
    return tensors, params


def offload_states(engine, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
    dev = device.value if isinstance(device, enum.Enum) else str(device)
    if dev == OffloadDevice.none.value:
        warnings.warn("zerocore: offload_states(device='none'): nothing moved", RuntimeWarning, stacklevel=3)
        return
    if dev == OffloadDevice.nvme.value:
        raise ValueError("zerocore: offload_states(device='nvme') is not supported (as in DeepSpeed): use 'cpu'")
    if dev != OffloadDevice.cpu.value:
        raise ValueError(f"zerocore: offload_states(device={device!r}): the states can be moved to 'cpu' only")
    types = parse_include(include)
    aside: StatesAside = engine.__dict__.get("_zc_states_aside") or StatesAside()
    types -= aside.types  # a second call moves only what is still on the device
    if not types:
        return
    if engine.gatherer is not None:
        engine.gatherer.free_all()  # stage 3: no full buffer outlives the call (DeepSpeed: empty_partition_cache)
    if engine.reducer.pool is not None:
        engine.reducer.pool.release()  # contiguous_grad_buffer: nothing is held between steps
    pin = should_pin(pin_memory, engine.device)
    tensors, params = _candidates(engine, types)
    # storage data_ptr -> its move (views of one storage move once; a storage moved by an earlier call
    # has zero bytes now and is not a candidate)
    moved: dict[int, _Moved] = {}
    with torch.no_grad():
        for t in tensors:
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in moved or not st.resizable():
                # not resizable: host memory of zerocore's own page-aligned allocator (a CPU device's
                # optimizer state), already where offloading would put it
                continue
            host = torch.empty(st.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.copy_(_byte_view(st, t.device), non_blocking=non_blocking)
            moved[key] = _Moved(st, t.device, host)
        # parameters that live in a moved storage are shown from its host copy meanwhile
        for p in params:
            m = moved.get(p.untyped_storage().data_ptr())
            if m is None:
                continue
            d = p.data
            aside.params.append((p, d))
            p.data = m.host.view(d.dtype).as_strided(d.shape, d.stride(), d.storage_offset())
        if engine.device.type == "cuda" and not non_blocking:
            torch.cuda.current_stream(engine.device).synchronize()
        for m in moved.values():
            m.storage.resize_(0)  # the device memory goes back to the allocator; every view stays valid to restore
    aside.moved += moved.values()
    aside.types |= types
    engine.__dict__["_zc_states_aside"] = aside


def reload_states(engine, non_blocking: bool = False) -> None:
    aside: StatesAside | None = engine.__dict__.pop("_zc_states_aside", None)
    if aside is None:
        return
    with torch.no_grad():
        for m in aside.moved:
            m.storage.resize_(m.nbytes)
            _byte_view(m.storage, m.device).copy_(m.host, non_blocking=non_blocking)
        for p, d in aside.params:
            p.data = d
    if engine.device.type == "cuda" and not non_blocking:
        torch.cuda.current_stream(engine.device).synchronize()
    # the host buffers go with ``aside``: pinned ones back to torch's pinned-memory cache (a non-blocking
    # copy still reading one keeps it until the copy is done: torch records the copy's event)


def check_resident(engine, what: str) -> None:
    """Raises, naming ``reload_states()``, while states are offloaded."""
    if "_zc_states_aside" in engine.__dict__:
        raise RuntimeError(OFFLOADED.format(what=what))
