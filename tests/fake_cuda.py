"""Stand-ins for CUDA without a GPU: tensors that say they are on cuda:0 (CPU memory behind
them, so addresses and overlaps are real) and an extension module that records the CUDA calls
it would have launched. Used by the tests of the Python routing and argument checks."""
from __future__ import annotations

import torch


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:0: enough for the Python-side routing and checks."""

    @property
    def is_cuda(self):
        return True

    @property
    def is_cpu(self):
        return False

    @property
    def device(self):
        return torch.device("cuda", 0)


def fake(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype).as_subclass(FakeCuda)


class FakePinned(torch.Tensor):
    """A CPU tensor that says it is page-locked (pinning needs a CUDA runtime)."""

    def is_pinned(self, device=None):
        return True


def pinned(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype).as_subclass(FakePinned)


class Recorder:
    """Stands in for the extension's CUDA functions: records every call."""

    WITH_CUDA = True

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if not name.startswith("cuda_"):
            raise AttributeError(name)

        def record(*args):
            self.calls.append((name, args))
            if name == "cuda_sum_squares":
                return torch.tensor(4.0, dtype=torch.float64), torch.tensor(False)
            if name == "cuda_sum_squares_multi":  # rows of (sum of squares, Inf/NaN) per tensor
                return torch.tensor([[4.0, 0.0]] * len(args[0]), dtype=torch.float64)

        return record


def install_recorder(monkeypatch) -> Recorder:
    """Routes zerocore.ops' CUDA paths to a fresh Recorder (stream handle 1234)."""
    from zerocore.ops.cuda import _lib, kernels

    rec = Recorder()
    monkeypatch.setattr(_lib, "_module", lambda: rec)
    monkeypatch.setattr(kernels, "stream_handle", lambda device: 1234)
    return rec
