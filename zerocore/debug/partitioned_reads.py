"""Every use of a stage-3 parameter while it is partitioned, named (or raised on) with its call site.

    with zerocore.debug.partitioned_reads() as log:     # raise_on_read=True: raise at the first one
        trainer.train()
    print(log.count, log)                               # each read: the parameter, what, file:line

Outside its module's forward a stage-3 parameter (and one built under ``zerocore.init``) is the
empty tensor: this rank's chunk lives in its engine. Code that uses it there gets no error, only an
empty value: ``lm_head.weight @ h`` of a 0-element weight, ``weight.shape[0] == 0``, ``state_dict()``
of empty tensors, ``p.data.copy_(x)`` that is lost (DeepSpeed's ZeRO-3 parameters behave the same
way; a ``copy.deepcopy`` of one, which would copy nothing, zerocore refuses outright). TRL's
distillation loss projected with a teacher's ``lm_head`` weight read after the teacher's forward had
returned: its loss was 0.0 at stage 3. This mode names each such use: every torch function, method
or attribute (``shape``, ``data``, ``numel()``, ``__repr__``...) given a stage-3 parameter that
holds no values then, from code outside torch and zerocore (zerocore's own gathers and releases use
them so, by design).

Not counted, since they answer the same for the empty stand-in as for the whole parameter:
``dtype``, ``device``, ``requires_grad`` (and ``requires_grad_``), ``grad``, ``is_leaf``,
``is_floating_point()``, ``element_size()``, hashing, and the ``ds_*`` attributes DeepSpeed's
face adds (``ds_shape`` / ``ds_numel`` give the whole shape). Use ``zerocore.gathered([params])``
(DeepSpeed's ``GatheredParameters``) to read or change the whole values outside a forward.

Off (no context entered) this costs nothing. On, each torch call in the thread that entered it looks
through its arguments (a torch function mode); only a call that is given such a parameter looks
for its call site.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

from ..runtime.ds_param_attrs import is_partitioned_now

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_ZEROCORE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# zerocore frames that act for their caller (the parameters' own class: its __deepcopy__), passed over like torch's
_ACTING_FOR_CALLER = (os.path.join(_ZEROCORE_DIR, "runtime", "ds_param_attrs.py"),)

# attributes and methods whose answer does not depend on the values (the same for the empty stand-in)
_SAME_WHEN_EMPTY = frozenset({
    "dtype", "device", "requires_grad", "requires_grad_", "grad", "_grad", "is_leaf", "grad_fn", "layout",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_floating_point", "is_complex",
    "element_size", "itemsize", "__hash__", "get_device", "type", "register_hook",
    "register_post_accumulate_grad_hook", "_version",
})


@dataclasses.dataclass(frozen=True)
class PartitionedRead:
    param: str  # the parameter's name in its engine's model (or what zerocore.init knows of it)
    what: str  # the torch function, method or attribute
    site: str  # "file:line in function": the first frame outside torch and zerocore

    def __str__(self) -> str:
        return f"{self.param}: {self.what} at {self.site}"


class PartitionedReadError(RuntimeError):
    """Raised at a use of a partitioned parameter inside ``partitioned_reads(raise_on_read=True)``."""


@dataclasses.dataclass
class PartitionedReadLog:
    reads: list[PartitionedRead] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.reads)

    def __len__(self) -> int:
        return len(self.reads)

    def __str__(self) -> str:
        if not self.reads:
            return "no use of a partitioned parameter"
        return "\n".join(str(r) for r in self.reads)


@contextlib.contextmanager
def partitioned_reads(raise_on_read: bool = False):
    """Counts (``raise_on_read``: raises :class:`PartitionedReadError` at) each use of a stage-3 parameter
    while it holds no values, in the thread that entered; yields the :class:`PartitionedReadLog`."""
    log = PartitionedReadLog()
    with _Watch(log, raise_on_read):
        yield log


class _Watch(TorchFunctionMode):
    def __init__(self, log: PartitionedReadLog, raise_on_read: bool):
        super().__init__()
        self.log, self.raise_on_read = log, raise_on_read

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _name_of(func)
        if what not in _SAME_WHEN_EMPTY:
            for t in _tensors(args, kwargs):
                if isinstance(t, torch.nn.Parameter) and is_partitioned_now(t):
                    self._note(t, what)
                    break
        return func(*args, **kwargs)

    def _note(self, p: torch.nn.Parameter, what: str) -> None:
        site = _site()
        if site is None:  # torch's or zerocore's own use
            return
        from ..runtime.gathered import describe

        read = PartitionedRead(describe(p), what, site)
        self.log.reads.append(read)
        if self.raise_on_read:
            raise PartitionedReadError(
                f"zerocore: {read.what} of stage-3 parameter {read.param} at {read.site}, where it is partitioned "
                "(this rank holds a chunk; the parameter is the empty tensor outside its module's forward). Read "
                "it inside that forward, or gather it with zerocore.gathered([param]) (DeepSpeed's "
                "GatheredParameters)")


def _tensors(args, kwargs):
    """The arguments, and the items of list / tuple arguments (``torch.cat``, the ``_foreach_`` functions); not
    the insides of other containers (``__deepcopy__``'s memo holds every object copied so far)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _name_of(func) -> str:
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):  # a property: its descriptor names the attribute
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name)
    return name


def _site() -> str | None:
    """The first frame outside torch, contextlib and copy; None if that one is zerocore's (its own use)."""
    f = sys._getframe(3)  # (_site, _note, __torch_function__ are this module's)
    while f is not None and (f.f_code.co_filename.startswith((_TORCH_DIR, contextlib.__file__, copy.__file__))
                             or f.f_code.co_filename in _ACTING_FOR_CALLER):
        f = f.f_back
    if f is None or f.f_code.co_filename.startswith(_ZEROCORE_DIR):
        return None
    return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"
