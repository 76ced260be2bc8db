"""What the NVMe I/O engine's tests (tests/offload/test_aio.py, test_aio_options.py) share: why the
engine is missing (REASON, None when it was built), the backends usable here, and test tensors."""
from __future__ import annotations

import torch

from zerocore.ops import aio as zaio

REASON = zaio.aio_unavailable()
BACKENDS = [b for b, why in zaio.available_backends().items() if why is None] if REASON is None else []


def random_tensor(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return torch.randn(n, generator=g).to(dtype)



def buffer(n: int, dtype: torch.dtype, memory: str) -> torch.Tensor:
    """'aligned': page-aligned, locked; 'shifted': one element past a page boundary (forces
    the bounce path); 'torch': whatever torch.empty gives."""
    if memory == "aligned":
        t = zaio.aligned_pinned_empty(n, dtype)
        assert t.data_ptr() % 4096 == 0
        return t
    if memory == "shifted":
        t = zaio.aligned_pinned_empty(n + 1, dtype)[1:]
        assert t.data_ptr() % 4096 != 0
        return t
    return torch.empty(n, dtype=dtype)



def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

