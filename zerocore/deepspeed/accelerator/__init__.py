"""``deepspeed.accelerator.get_accelerator()``: the device facts scripts ask for (name, count,
current device, backend, seeds), for CUDA when torch has it, else the CPU."""
from __future__ import annotations

import os

import torch


class _Accelerator:
    def __init__(self, name: str):
        self._name = name
        self._communication_backend_name = "nccl" if name == "cuda" else "gloo"

    # -- names and devices -------------------------------------------------------------------
    def device_name(self, device_index=None) -> str:
        return self._name if device_index is None or self._name == "cpu" else f"{self._name}:{device_index}"

    def device(self, device_index=None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def is_available(self) -> bool:
        return self._name == "cpu" or torch.cuda.is_available()

    def device_count(self) -> int:
        """CUDA's device count; on the CPU, as DeepSpeed's CPU accelerator, LOCAL_SIZE (the ranks a
        launcher put on this node) when set, else 1."""
        if self._name == "cuda":
            return torch.cuda.device_count()
        return max(int(os.environ.get("LOCAL_SIZE", 0) or 0), 1)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._name == "cuda" else "cpu"

    def set_device(self, device_index) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def synchronize(self, device_index=None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    # -- dtypes ------------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        if self._name == "cuda":
            return True
        # DeepSpeed's CPU accelerator: only where oneDNN has fp16 kernels for this CPU (zero.Init's
        # default dtype follows it, zero.py init_dtype)
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:  # noqa: BLE001 - a torch without the query: no fp16, as DeepSpeed answers
            return False

    def supported_dtypes(self) -> list:
        return [torch.float32, torch.float16, torch.bfloat16]

    # -- random numbers ----------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._name == "cuda":
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    # -- memory ------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def pin_memory(self, tensor, align_bytes: int = 1):
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == self._name


_ACCELERATOR: _Accelerator | None = None


def get_accelerator() -> _Accelerator:
    """CUDA when torch sees a GPU (unless DS_ACCELERATOR=cpu), else the CPU."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        wanted = os.environ.get("DS_ACCELERATOR")
        _ACCELERATOR = _Accelerator("cuda" if wanted != "cpu" and torch.cuda.is_available() else "cpu")
    return _ACCELERATOR


def is_current_accelerator_supported() -> bool:
    """DeepSpeed's check that its accelerator is one it supports: here CUDA or the CPU, always."""
    return get_accelerator().device_name() in ("cuda", "cpu")


__all__ = ["get_accelerator", "is_current_accelerator_supported"]
