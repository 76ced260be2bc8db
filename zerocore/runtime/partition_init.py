"""``with zerocore.init(config):`` — partition parameters as the model is built (stage 3).

Every ``nn.Module`` subclass's ``__init__`` is wrapped while the context is open. When a
module's outermost ``__init__`` returns, each parameter it registered directly is partitioned:
broadcast from rank 0 (so every rank starts from the same values), the rank keeps only its
chunk of it, and the parameter's ``.data`` becomes an empty tensor. Partitioning waits until
the next module's ``__init__`` starts or ends (or the outermost one returns): a parent may still
initialize the child it just built, as ``nn.MultiheadAttention`` does with its ``out_proj.bias``
right after creating ``out_proj``. So at most two modules' own parameters exist in full at a
time, and a model larger than one rank's memory can be built. ``zerocore.initialize`` then
regroups the chunks into the units' flat groups, one group at a time.

As with DeepSpeed's ``zero.Init``, a parameter must otherwise be initialized inside the
``__init__`` of the module that registers it: once partitioned, an in-place change made later
(a parent module calling ``nn.init.normal_(self.emb.weight)`` after building other modules, as
TinyGPT does) would be lost. zerocore notices (the parameter's version counter moved, or its
``.data`` was replaced) and raises, naming the parameter; make such changes under
``zerocore.gathered([param], modifier_rank=0)``. (A change through ``param.data`` in place, as
``param.data.normal_()``, cannot be noticed: ``.data`` does not share the version counter.)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import torch
from torch import nn

from ..comm import Comm, default_comm
from .ds_param_attrs import mark_init


@dataclasses.dataclass
class InitShard:
    """What a parameter partitioned at construction keeps (as ``param._zc_init``)."""

    shape: torch.Size
    chunk: torch.Tensor  # this rank's piece of the flattened parameter (chunk_numel elements, zero-padded)
    world: int
    version: int  # the parameter's version counter when partitioned (in-place edits move it)
    owner: str  # the module class that registered it (for error messages)
    open: bool = False  # whole for a while, under zerocore.gathered()
    sanity_checks: bool = False  # the init config's zero_optimization.enable_sanity_checks (runtime/gathered.py)
    made: str = ""  # when it was partitioned, if not by zerocore.init (for the message of check_unchanged)

    @property
    def numel(self) -> int:
        return self.shape.numel()


def cut_chunk(flat: torch.Tensor, chunk: torch.Tensor, rank: int) -> None:
    """Writes rank ``rank``'s piece of the flattened parameter ``flat`` into ``chunk`` (zero past
    the parameter's end: the padding of the last ranks)."""
    size = chunk.numel()
    lo, hi = rank * size, min((rank + 1) * size, flat.numel())
    chunk.zero_()
    if hi > lo:
        chunk[:hi - lo] = flat[lo:hi]


def chunk_numel(numel: int, world: int) -> int:
    """The elements of each rank's chunk: DeepSpeed's partition size, ``ceil(numel / world)`` (at
    least 1); the last ranks' chunks are zero-padded past the parameter's end."""
    return max(1, -(-numel // world))


def partition_param(p: nn.Parameter, comm: Comm, owner: str, sanity_checks: bool = False) -> None:
    full = p.data
    comm.broadcast(full)
    chunk = torch.empty(chunk_numel(full.numel(), comm.world), dtype=full.dtype, device=full.device)
    cut_chunk(full.reshape(-1), chunk, comm.rank)
    p.data = torch.empty(0, dtype=full.dtype, device=full.device)
    p._zc_init = InitShard(full.shape, chunk, comm.world, p._version, owner, sanity_checks=sanity_checks)
    mark_init(p)  # DeepSpeed's ds_* attributes (ds_param_attrs.py)


def gather_full(p: nn.Parameter, comm: Comm) -> torch.Tensor:
    """The whole value of a parameter partitioned at construction (a collective)."""
    rec: InitShard = p._zc_init
    out = torch.empty(rec.chunk.numel() * rec.world, dtype=rec.chunk.dtype, device=rec.chunk.device)
    comm.all_gather_into(out, rec.chunk)
    return out[:rec.numel].view(rec.shape)


def check_unchanged(p: nn.Parameter, name: str) -> None:
    rec = getattr(p, "_zc_init", None)
    if rec is None or rec.open:
        return
    how = ("was modified in place" if p._version != rec.version
           else "had its .data replaced" if p.data.numel() != 0 else None)
    if how is not None:
        when = rec.made or f"at the end of {rec.owner}.__init__"
        raise RuntimeError(
            f"zerocore.init: parameter '{name}' {how} after it was partitioned ({when}); the change is lost. "
            "Initialize a parameter in the __init__ of the module that registers it, or make the change under "
            "zerocore.gathered([param], modifier_rank=0).")


def initial_value(p: nn.Parameter, comm: Comm) -> torch.Tensor:
    """A parameter's full value as fp32, flattened (gathered if zerocore.init partitioned it); the
    construction-time record is dropped, the engine's groups own the values from now on."""
    rec = getattr(p, "_zc_init", None)
    if rec is None:
        return p.detach().reshape(-1).float()
    value = gather_full(p, comm).reshape(-1).float()
    del p._zc_init
    return value


class _Patcher:
    """Wraps ``__init__`` of every nn.Module subclass (and of those defined inside the context)."""

    def __init__(self, comm: Comm, dtype: torch.dtype | None, device: torch.device | None, after_module,
                 sanity_checks: bool = False):
        self.comm = comm
        self.sanity_checks = sanity_checks
        self.dtype = dtype
        self.device = device
        self.after_module = after_module
        self.saved: dict[type, object] = {}
        # parameters of the module whose __init__ returned last, still whole (see the module docstring)
        self.pending: list[tuple[nn.Parameter, str]] = []
        self.running = 0  # module __init__s under way (each object's outermost one)

    def _wrap(self, cls: type) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or cls in self.saved:
            return
        self.saved[cls] = orig
        patcher = self

        @functools.wraps(orig)
        def __init__(module, *args, **kwargs):
            depth = module.__dict__.get("_zc_init_depth", 0)
            if depth == 0:  # the object's outermost __init__ (subclasses call super().__init__)
                patcher.flush()  # a new module: the last one's parameters can no longer change
                patcher.running += 1
            module.__dict__["_zc_init_depth"] = depth + 1
            try:
                orig(module, *args, **kwargs)
            except BaseException:
                if depth == 0:
                    patcher.running -= 1
                    module.__dict__.pop("_zc_init_depth", None)
                raise
            module.__dict__["_zc_init_depth"] = depth
            if depth == 0:
                patcher.running -= 1
                del module.__dict__["_zc_init_depth"]
                patcher.finish(module)

        cls.__init__ = __init__

    def finish(self, module: nn.Module) -> None:
        self.flush()  # a child built last (and maybe initialized by this __init__) first
        for name, p in module.named_parameters():
            check_unchanged(p, name)  # a child's parameter changed by this module's __init__?
        owner = type(module).__name__
        seen = {id(p) for p, _ in self.pending}
        for p in module._parameters.values():
            # (on the meta device: built by torch.nn.utils.skip_init, partitioned after its to_empty())
            if p is None or hasattr(p, "_zc_init") or not p.is_floating_point() or p.is_meta or id(p) in seen:
                continue
            seen.add(id(p))
            self.pending.append((p, owner))
        if self.after_module is not None:
            self.after_module(module)
        if self.running == 0:  # the outermost module is built
            self.flush()

    def after_to_empty(self, meta: list[tuple[nn.Module, str]]) -> None:
        """``to_empty()`` gave storage to parameters built on the meta device (``skip_init`` builds a
        module there, then calls it; ``meta``: (module, name) of each such parameter): they are
        partitioned as any new parameter."""
        for sub, name in meta:
            p = sub._parameters.get(name)
            if p is not None and not p.is_meta and not hasattr(p, "_zc_init") and p.is_floating_point():
                self.pending.append((p, type(sub).__name__))
        if self.running == 0:
            self.flush()

    def flush(self) -> None:
        """Partitions the pending parameters (a collective: every rank builds the same modules)."""
        pending, self.pending = self.pending, []
        for p, owner in pending:
            if hasattr(p, "_zc_init"):
                continue
            if self.device is not None and p.device.type != self.device.type:
                p.data = p.data.to(self.device)
            if self.dtype is not None and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
            partition_param(p, self.comm, owner, self.sanity_checks)

    def __enter__(self):
        stack = [nn.Module]
        while stack:
            cls = stack.pop()
            self._wrap(cls)
            stack.extend(cls.__subclasses__())
        patcher = self
        self._old_init_subclass = nn.Module.__dict__.get("__init_subclass__")

        @classmethod
        def __init_subclass__(cls, **kwargs):
            super(nn.Module, cls).__init_subclass__(**kwargs)
            patcher._wrap(cls)

        nn.Module.__init_subclass__ = __init_subclass__
        self._old_to_empty = nn.Module.__dict__["to_empty"]
        to_empty = self._old_to_empty

        @functools.wraps(to_empty)
        def _to_empty(module, *args, **kwargs):
            meta = [(sub, n) for sub in module.modules() for n, p in sub._parameters.items()
                    if p is not None and p.is_meta]
            out = to_empty(module, *args, **kwargs)
            if meta:
                patcher.after_to_empty(meta)
            return out

        nn.Module.to_empty = _to_empty
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.flush()
        else:  # a failed build: no collective here (the ranks may not all have got this far)
            self.pending.clear()
        nn.Module.to_empty = self._old_to_empty
        for cls, orig in self.saved.items():
            cls.__init__ = orig
        if self._old_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._old_init_subclass
        return False


@contextlib.contextmanager
def init(config=None, *, dtype: torch.dtype | None = None, device: torch.device | None = None,
         after_module: Callable[[nn.Module], object] | None = None):
    """Builds models with their parameters partitioned across the ranks as they are created.

    ``config``: the config later given to ``zerocore.initialize`` (only read to check that it
    asks for stage 3). ``dtype``, ``device``: convert parameters to this dtype, move them to this
    kind of device, before partitioning (None: as made, except over NCCL, where they go to this
    rank's GPU: ``collective_device``; fp32 chunks of a bf16 run are converted at ``initialize``).
    ``after_module(module)``: called as each module's outermost ``__init__`` returns. Needs the
    process group (or torchrun's environment); one rank: a single chunk.
    """
    sanity_checks = False
    if config is not None:
        from ..config import load_config

        cfg = load_config(config)
        if cfg.zero_optimization.stage != 3:
            raise ValueError(f"zerocore.init partitions parameters for stage 3; the config has "
                             f"zero_optimization.stage={cfg.zero_optimization.stage}")
        sanity_checks = cfg.zero_optimization.enable_sanity_checks
    comm = default_comm()
    with _Patcher(comm, dtype, device if device is not None else collective_device(comm), after_module,
                  sanity_checks):
        yield


def collective_device(comm: Comm) -> torch.device | None:
    """Where parameters built on the host go before they are partitioned when no ``device`` is given: over NCCL
    this rank's GPU (its collectives take device tensors only; DeepSpeed's ``zero.Init`` places them on the
    accelerator the same way), elsewhere None (where they were made)."""
    if comm.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None
