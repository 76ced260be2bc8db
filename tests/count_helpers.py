"""Counting the engine's host work per training step, for the counted (not timed) tests.

``ZerocoreCounter`` counts, on the thread that trains (where autograd runs the engine's hooks on
a CPU), what the code of the ``zerocore`` package does:

- ``python``: calls of Python functions defined in the package (``sys.setprofile`` 'call' events);
- ``native``: calls of functions implemented in C made *from* the package's code
  (``sys.setprofile`` 'c_call' events whose calling frame is in the package): builtins
  (``len``, ``zip``, ``isinstance``), tensor methods, the collectives' and the kernels' bindings;
- ``lines``: source lines of the package executed (``sys.settrace`` 'line' events, traced only in
  the package's frames). This is what catches a per-parameter loop whose body calls nothing:
  ``p.data = v``, ``p.grad = None`` or a dict write are C attribute setters, which raise no
  profile event at all, but each iteration executes its lines. (A ``TorchFunctionMode`` would see
  tensor attribute setters, but autograd runs the backward hooks inside ``Tensor.backward``,
  while the mode is switched off, so it would miss the backward.)
- ``kernels``: the subset of ``native`` that are zerocore's own compiled functions (``zerocore._C``);
- ``collectives``: calls of the collective wrappers in ``zerocore/comm/collectives.py``.

Each count also keeps where it came from (``sites``), so a test can name what grew.
"""
from __future__ import annotations

import collections
import os
import sys

import torch

import zerocore

PKG = os.path.dirname(zerocore.__file__) + os.sep
COMM_FILE = os.path.join(PKG, "comm", "collectives.py")
COLLECTIVES = {"reduce_scatter", "all_reduce", "all_gather", "all_gather_into", "broadcast", "sum_floats"}
KINDS = ("python", "native", "kernels", "lines", "collectives")

# the model and configs of benchmarks/backward_overhead.py: what is counted here is what is timed there
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from backward_overhead import make_model, stage_config  # noqa: E402


# the divergence guard's wait for the other ranks' headers (comm/shm_headers.py): its iterations measure how long
# this rank waited, not what it did (over gloo the same wait is one native call)
WAIT_FILE, WAIT_NAME = os.path.join(PKG, "comm", "shm_headers.py"), "_wait"


def _waiting(frame) -> bool:
    """``frame`` is the headers' wait or a call it made."""
    for f in (frame, frame.f_back):
        if f is not None and f.f_code.co_name == WAIT_NAME and f.f_code.co_filename == WAIT_FILE:
            return True
    return False


def _where(code) -> str:
    return f"{code.co_filename[len(PKG):]}:{code.co_name}"


class ZerocoreCounter:
    """Counts the zerocore package's Python calls, native calls, executed lines and collectives
    while in a ``with`` block (this thread only)."""

    def __init__(self):
        self.sites = {k: collections.Counter() for k in KINDS}

    def totals(self) -> dict[str, int]:
        return {k: sum(c.values()) for k, c in self.sites.items()}

    def _profile(self, frame, event, arg):
        code = frame.f_code
        if not code.co_filename.startswith(PKG) or _waiting(frame):
            return
        if event == "call":
            self.sites["python"][_where(code)] += 1
            if code.co_filename == COMM_FILE and code.co_name in COLLECTIVES:
                self.sites["collectives"][code.co_name] += 1
        elif event == "c_call":
            site = f"{_where(code)} -> {getattr(arg, '__qualname__', None) or arg!r}"
            self.sites["native"][site] += 1
            if (getattr(arg, "__module__", None) or "").startswith("zerocore"):
                self.sites["kernels"][site] += 1

    def _trace(self, frame, event, arg):  # new frames: trace lines only in the package's code
        return self._line if frame.f_code.co_filename.startswith(PKG) and not _waiting(frame) else None

    def _line(self, frame, event, arg):
        if event == "line":
            self.sites["lines"][f"{_where(frame.f_code)}:{frame.f_lineno}"] += 1
        return self._line

    def __enter__(self):
        sys.settrace(self._trace)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        sys.settrace(None)


def one_step(engine, x) -> None:
    engine.backward(engine(x).square().mean())
    engine.step()


def count_step(case: dict, rank: int, world: int) -> dict:
    """One spawned rank: builds the benchmark's model (``case``: blocks, params_per_block, stage),
    takes two warm-up steps (unit orders recorded, buckets allocated), then counts one step
    (forward + backward + optimizer step). Returns the totals and the sites."""
    torch.manual_seed(100 + rank)
    x = torch.randn(8, 16)
    engine = zerocore.initialize(make_model(case["blocks"], 16, case["params_per_block"]), stage_config(case["stage"]))
    for _ in range(2):
        one_step(engine, x)
    with ZerocoreCounter() as c:
        one_step(engine, x)
    out = {"params": sum(1 for _ in engine.module.parameters()), "groups": len(engine.groups),
           "totals": c.totals(), "sites": {k: dict(v) for k, v in c.sites.items()}}
    engine.reducer.remove_hooks()
    return out


def grown_sites(small: dict, large: dict, kind: str, top: int = 12) -> list[str]:
    """The sites of ``kind`` counted more often in ``large`` than in ``small``, largest growth first."""
    a, b = small["sites"][kind], large["sites"][kind]
    grown = sorted(((b.get(s, 0) - a.get(s, 0), s) for s in set(a) | set(b)), reverse=True)
    return [f"{d:+d} {s}" for d, s in grown[:top] if d > 0]
