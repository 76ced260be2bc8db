"""``deepspeed.runtime.utils.see_memory_usage``: a memory report printed by rank 0."""
from __future__ import annotations

import gc

import psutil
import torch
import torch.distributed as dist

_GiB = 1024 ** 3


def see_memory_usage(message: str, force: bool = False) -> None:
    """With ``force``, rank 0 prints ``message``, the accelerator's allocated and reserved memory
    (now and peak, in GiB; 0 on the CPU) and the host's used virtual memory, then resets the
    device's peak counters. Without ``force`` nothing (DeepSpeed's default)."""
    if not force or dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    gc.collect()  # what is only waiting for the collector is not in use
    print(message)
    if torch.cuda.is_available():
        print(f"MA {torch.cuda.memory_allocated() / _GiB:.2f} GB  Max_MA {torch.cuda.max_memory_allocated() / _GiB:.2f} "
              f"GB  CA {torch.cuda.memory_reserved() / _GiB:.2f} GB  Max_CA "
              f"{torch.cuda.max_memory_reserved() / _GiB:.2f} GB")
        torch.cuda.reset_peak_memory_stats()
    vm = psutil.virtual_memory()
    print(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / _GiB:.2f} GB, percent = {vm.percent}%")
