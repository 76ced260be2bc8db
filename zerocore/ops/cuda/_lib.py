"""Finding the CUDA half of the native extension, and the small helpers every CUDA op uses."""
from __future__ import annotations

import torch

from .. import _loader


class CudaUnavailableError(RuntimeError):
    """The CUDA kernels are not built into this installation (or cannot be loaded)."""


def _module():
    """The loaded extension if it carries the CUDA kernels, else None (never builds twice: the
    loader remembers its module or its failure)."""
    try:
        mod = _loader.load("cuda")
    except Exception:  # noqa: BLE001 - the reason is reported by unavailable_reason()
        return None
    return mod if getattr(mod, "WITH_CUDA", False) else None


def available() -> bool:
    """Whether CUDA tensors passed to zerocore.ops run on zerocore's CUDA kernels."""
    return _module() is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ('' when it is True)."""
    try:
        mod = _loader.load("cuda")
    except Exception as exc:  # noqa: BLE001
        return f"the native extension did not load: {exc}"
    if getattr(mod, "WITH_CUDA", False):
        return ""
    why = _loader.unavailable_parts().get("cuda")
    return why or "the native extension was built without its CUDA part"


def lib():
    """The extension module with the CUDA kernels; raises :class:`CudaUnavailableError` naming
    the reason and the fix when they are not built in."""
    mod = _module()
    if mod is None:
        raise CudaUnavailableError(
            "zerocore's CUDA kernels are not built into this installation: " + unavailable_reason() +
            ". Build against a CUDA torch with nvcc installed: `pip install --no-build-isolation .` "
            "(see docs/wheels.md).")
    return mod


def is_cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cuda


def routes(*tensors) -> bool:
    """True when one of the tensors is a CUDA tensor and the CUDA kernels are built: the op
    then goes to its CUDA path. With no CUDA kernels it is False and the op's CPU path raises
    its usual 'not built' error."""
    for t in tensors:  # a plain loop: called once per op on the engine's hot path
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return available()
    return False


def stream_handle(device: torch.device) -> int:
    """The raw cudaStream_t of the current stream of ``device``, as the kernels take it."""
    return torch.cuda.current_stream(device).cuda_stream


def build_info() -> dict:
    """What the CUDA part contains and what it sees: for `zerocore env` and bug reports."""
    mod = _module()
    if mod is None:
        return {"built": False, "reason": unavailable_reason()}
    archs = [int(a) for a in mod.cuda_compiled_archs()]
    info = {
        "built": True,
        "archs": ["sm_%d" % (a // 10) for a in archs],
        "cuda_runtime": "%d.%d" % (mod.cuda_runtime_version() // 1000, mod.cuda_runtime_version() % 1000 // 10),
        "devices": mod.cuda_device_count(),
    }
    if info["devices"] == 0:
        info["device_error"] = mod.cuda_device_error()
    images = {}
    for d in range(info["devices"]):
        try:
            binary, ptx = mod.cuda_kernel_versions(d)
            images[f"cuda:{d}"] = f"runs sm_{binary} code (PTX version {ptx})"
        except RuntimeError as exc:
            images[f"cuda:{d}"] = f"no usable kernel image: {exc}"
    if images:
        info["kernel_image"] = images
    return info
