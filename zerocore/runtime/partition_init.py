"""``with zerocore.init(config):`` — partition parameters as the model is built (stage 3).

Every ``nn.Module`` subclass's ``__init__`` is wrapped while the context is open: when a
module's outermost ``__init__`` returns, each parameter it registered directly is broadcast
from rank 0 (so every rank starts from the same values), and the rank keeps only its chunk of
it; the parameter's ``.data`` becomes an empty tensor. So at most one module's parameters
exist in full at a time, and a model larger than one rank's memory can be built.
``zerocore.initialize`` then regroups the chunks into the units' flat groups, one group at a
time.

As with DeepSpeed's ``zero.Init``, a parameter must be initialized inside the ``__init__`` of the
module that registers it: once that ``__init__`` has returned the parameter is partitioned, and
an in-place change made later (a parent module calling ``nn.init.normal_(self.emb.weight)``)
would be lost. zerocore notices (the parameter's version counter moved) and raises, naming the
parameter; make such changes under ``zerocore.gathered([param], modifier_rank=0)``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from torch import nn

from ..comm import Comm, default_comm
from ..sharding.records import padded_size


@dataclasses.dataclass
class InitShard:
    """What a parameter partitioned at construction keeps (as ``param._zc_init``)."""

    shape: torch.Size
    chunk: torch.Tensor  # this rank's piece of the flattened, padded parameter
    world: int
    version: int  # the parameter's version counter when partitioned (in-place edits move it)
    owner: str  # the module class that registered it (for error messages)

    @property
    def numel(self) -> int:
        return self.shape.numel()


def partition_param(p: nn.Parameter, comm: Comm, owner: str) -> None:
    full = p.data
    comm.broadcast(full)
    flat = full.reshape(-1)
    padded = padded_size(flat.numel(), comm.world)
    size = padded // comm.world
    chunk = torch.zeros(size, dtype=full.dtype, device=full.device)
    lo, hi = comm.rank * size, min((comm.rank + 1) * size, flat.numel())
    if hi > lo:
        chunk[:hi - lo] = flat[lo:hi]
    p.data = torch.empty(0, dtype=full.dtype, device=full.device)
    p._zc_init = InitShard(full.shape, chunk, comm.world, p._version, owner)


def gather_full(p: nn.Parameter, comm: Comm) -> torch.Tensor:
    """The whole value of a parameter partitioned at construction (a collective)."""
    rec: InitShard = p._zc_init
    out = torch.empty(rec.chunk.numel() * rec.world, dtype=rec.chunk.dtype, device=rec.chunk.device)
    comm.all_gather_into(out, rec.chunk)
    return out[:rec.numel].view(rec.shape)


def check_unchanged(p: nn.Parameter, name: str) -> None:
    rec = getattr(p, "_zc_init", None)
    if rec is not None and p._version != rec.version:
        raise RuntimeError(
            f"zerocore.init: parameter '{name}' was modified in place after it was partitioned (at the end of "
            f"{rec.owner}.__init__); the change is lost. Initialize a parameter in the __init__ of the module that "
            f"registers it, or make the change under zerocore.gathered([param], modifier_rank=0).")


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

    def __init__(self, comm: Comm, dtype: torch.dtype | None):
        self.comm = comm
        self.dtype = dtype
        self.saved: dict[type, object] = {}

    def _wrap(self, cls: type) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or cls in self.saved:
            return
        self.saved[cls] = orig
        patcher = self

        @functools.wraps(orig)
        def __init__(module, *args, **kwargs):
            depth = module.__dict__.get("_zc_init_depth", 0)
            module.__dict__["_zc_init_depth"] = depth + 1
            try:
                orig(module, *args, **kwargs)
            finally:
                module.__dict__["_zc_init_depth"] = depth
            if depth == 0:  # the object's outermost __init__ (subclasses call super().__init__)
                del module.__dict__["_zc_init_depth"]
                patcher.partition(module)

        cls.__init__ = __init__

    def partition(self, module: nn.Module) -> None:
        for name, p in module.named_parameters():
            check_unchanged(p, name)  # a child's parameter changed by this module's __init__?
        for p in module._parameters.values():
            if p is None or hasattr(p, "_zc_init") or not p.is_floating_point():
                continue
            if self.dtype is not None and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
            partition_param(p, self.comm, type(module).__name__)

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
        return self

    def __exit__(self, *exc):
        for cls, orig in self.saved.items():
            cls.__init__ = orig
        if self._old_init_subclass is None:
            del nn.Module.__init_subclass__
        else:
            nn.Module.__init_subclass__ = self._old_init_subclass
        return False


@contextlib.contextmanager
def init(config=None, *, dtype: torch.dtype | None = None):
    """Builds models with their parameters partitioned across the ranks as they are created.

    ``config``: the config later given to ``zerocore.initialize`` (only read to check that it
    asks for stage 3). ``dtype``: convert parameters to this dtype before partitioning (fp32
    chunks of a bf16 run are converted at ``initialize`` otherwise). Needs the process group (or
    torchrun's environment); with one rank it partitions into a single chunk.
    """
    if config is not None:
        from ..config import load_config

        cfg = load_config(config)
        if cfg.zero_optimization.stage != 3:
            raise ValueError(f"zerocore.init partitions parameters for stage 3; the config has "
                             f"zero_optimization.stage={cfg.zero_optimization.stage}")
    with _Patcher(default_comm(), dtype):
        yield
