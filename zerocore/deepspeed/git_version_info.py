"""``deepspeed.git_version_info``: the version facts scripts and DeepSpeed's test helpers read.

``version`` is the DeepSpeed release whose API this face follows; ``torch_info`` describes the
torch running now (DeepSpeed records the one it was built against; zerocore builds against the
installed torch, so the two are the same). ``installed_ops``/``compatible_ops``: every op name
is False here, since DeepSpeed's op builders are not part of zerocore (its own kernels stand in,
see ``zerocore.deepspeed.ops``)."""
from __future__ import annotations

import torch

from .. import __version__ as zerocore_version

version = "0.19.8"  # the DeepSpeed API this face follows
git_hash = f"zerocore-{zerocore_version}"
git_branch = "zerocore"
installed_ops: dict[str, bool] = {}
compatible_ops: dict[str, bool] = {}


def _major_minor(v: str | None) -> str:
    return ".".join((v or "0.0").split("+")[0].split(".")[:2])


torch_info = {
    "version": _major_minor(torch.__version__),
    "bf16_support": True,
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": ".".join(map(str, torch.cuda.nccl.version()[:2])) if torch.cuda.is_available() else "0.0",
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}
